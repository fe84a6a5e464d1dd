"""relay keys: a per-job secret the control plane derives each version's relay credential from

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22 09:00:00
"""
import secrets

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('relay_secret', sa.String(length=64), nullable=True))
    jobs = sa.table('jobs', sa.column('id', sa.String), sa.column('relay_secret', sa.String))
    bind = op.get_bind()
    for (job_id,) in bind.execute(sa.select(jobs.c.id)).all():  # each existing job gets its own secret
        bind.execute(jobs.update().where(jobs.c.id == job_id).values(relay_secret=secrets.token_hex(32)))
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.alter_column('relay_secret', existing_type=sa.String(length=64), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('relay_secret')
