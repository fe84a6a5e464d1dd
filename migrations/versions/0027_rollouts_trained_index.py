"""rollouts by trained step: the fleet comparison and the archive sweep read a job's newest trained groups

Revision ID: 0027
Revises: 0026
Create Date: 2026-11-27 23:40:00
"""
from alembic import op


revision = '0027'
down_revision = '0026'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index('ix_rollouts_trained', 'rollouts', ['job_id', 'status', 'trained_step'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_rollouts_trained', table_name='rollouts')
