"""queue by version: the learner claims the oldest version first, so the queue index leads with it

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24 15:00:00
"""
from alembic import op


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('rollouts', schema=None) as batch_op:
        batch_op.drop_index('ix_rollouts_queue')
        batch_op.create_index('ix_rollouts_queue', ['job_id', 'status', 'version', 'created_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('rollouts', schema=None) as batch_op:
        batch_op.drop_index('ix_rollouts_queue')
        batch_op.create_index('ix_rollouts_queue', ['job_id', 'status', 'created_at'], unique=False)
