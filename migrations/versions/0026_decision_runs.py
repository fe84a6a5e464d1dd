"""decision runs: decisions are stored as changes, a repeat of the same action counted on the newest row

Revision ID: 0026
Revises: 0025
Create Date: 2026-11-27 21:00:00
"""
from alembic import op
import sqlalchemy as sa

import api.models


revision = '0026'
down_revision = '0025'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('decisions') as batch_op:
        batch_op.add_column(sa.Column('repeats', sa.Integer(), nullable=False, server_default='1'))
        batch_op.add_column(sa.Column('decided_at', api.models.UTCDateTime(timezone=True), nullable=True))
    op.execute("UPDATE decisions SET decided_at = created_at")
    with op.batch_alter_table('decisions') as batch_op:
        batch_op.alter_column('decided_at', existing_type=api.models.UTCDateTime(timezone=True), nullable=False)
        batch_op.create_index('ix_decisions_runs', ['job_id', 'worker_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('decisions') as batch_op:
        batch_op.drop_index('ix_decisions_runs')
        batch_op.drop_column('decided_at')
        batch_op.drop_column('repeats')
