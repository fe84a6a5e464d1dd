"""audit windows: a trusted worker's accepted groups are numbered, and a per-worker secret salt picks
the one group audited in each window of round(1/audit_rate) groups

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-24 21:00:00
"""
import secrets

from alembic import op
import sqlalchemy as sa


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('workers') as batch:
        batch.add_column(sa.Column('groups_numbered', sa.Integer(), nullable=False, server_default='0'))
        batch.add_column(sa.Column('audit_salt', sa.String(length=32), nullable=True))
    workers = sa.table('workers', sa.column('id', sa.String), sa.column('audit_salt', sa.String))
    conn = op.get_bind()
    for (worker_id,) in conn.execute(sa.select(workers.c.id)).all():
        conn.execute(workers.update().where(workers.c.id == worker_id).values(audit_salt=secrets.token_hex(16)))
    with op.batch_alter_table('workers') as batch:
        batch.alter_column('audit_salt', existing_type=sa.String(length=32), nullable=False)
    with op.batch_alter_table('rollouts') as batch:
        batch.add_column(sa.Column('seq', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('rollouts') as batch:
        batch.drop_column('seq')
    with op.batch_alter_table('workers') as batch:
        batch.drop_column('audit_salt')
        batch.drop_column('groups_numbered')
