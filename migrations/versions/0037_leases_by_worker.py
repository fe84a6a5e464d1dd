"""leases by worker and time: the lease idle rule walks back a worker's latest leases at every renewal and lease

Revision ID: 0037
Revises: 0036
Create Date: 2026-12-07 21:00:00
"""
from alembic import op


revision = '0037'
down_revision = '0036'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index('ix_leases_worker', 'leases', ['worker_id', 'created_at'])


def downgrade() -> None:
    op.drop_index('ix_leases_worker', table_name='leases')
