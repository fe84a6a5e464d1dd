"""shared fleet: learner hosts and their slots, queue positions, pauses, user quotas, cost estimates,
jobs' worker memory need,
ledger entries that name their step and what they pay for

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25 00:10:00
"""
from alembic import op
import sqlalchemy as sa

import api.models


revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'learner_hosts',
        sa.Column('name', sa.String(length=128), primary_key=True),
        sa.Column('slots', sa.Integer(), nullable=False),
        sa.Column('seen_at', api.models.UTCDateTime(timezone=True), nullable=False),
    )
    with op.batch_alter_table('users') as batch:
        batch.add_column(sa.Column('max_concurrent_jobs', sa.Integer(), nullable=True))
        batch.add_column(sa.Column('max_usd_per_day', sa.Float(), nullable=True))
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('queue_position', sa.Integer(), nullable=True))
        batch.add_column(sa.Column('paused_for', sa.String(length=16), nullable=True))
        batch.add_column(sa.Column('estimate_usd', sa.Float(), nullable=True))
        batch.add_column(sa.Column('memory_need_gb', sa.Float(), nullable=True))
    with op.batch_alter_table('ledger_entries') as batch:
        batch.add_column(sa.Column('step', sa.Integer(), nullable=True))
        batch.add_column(sa.Column('memo', sa.String(length=256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('ledger_entries') as batch:
        batch.drop_column('memo')
        batch.drop_column('step')
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('memory_need_gb')
        batch.drop_column('estimate_usd')
        batch.drop_column('paused_for')
        batch.drop_column('queue_position')
    with op.batch_alter_table('users') as batch:
        batch.drop_column('max_usd_per_day')
        batch.drop_column('max_concurrent_jobs')
    op.drop_table('learner_hosts')
