"""held-out evaluation: each version's accuracy on prompts the job never trains on (held-out prompts are
prompts in state "eval", which the pool never leases)

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-24 17:00:00
"""
from alembic import op
import sqlalchemy as sa
import api.models


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('eval_results',
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('prompts', sa.Integer(), nullable=False),
    sa.Column('greedy_accuracy', sa.Float(), nullable=True),
    sa.Column('sampled_accuracy', sa.Float(), nullable=True),
    sa.Column('sampled_reward_mean', sa.Float(), nullable=True),
    sa.Column('seconds', sa.Float(), nullable=False),
    sa.Column('created_at', api.models.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', 'step')
    )


def downgrade() -> None:
    op.drop_table('eval_results')
