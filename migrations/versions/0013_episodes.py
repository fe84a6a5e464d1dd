"""episodes: multi-turn samples played through the control plane, one row per (lease, prompt, sample)

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-25 04:10:00
"""
from alembic import op
import sqlalchemy as sa

import api.models


revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'episodes',
        sa.Column('lease_id', sa.String(length=32), sa.ForeignKey('leases.id', ondelete='CASCADE'), primary_key=True),
        sa.Column('prompt_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), sa.ForeignKey('prompts.id', ondelete='CASCADE'), primary_key=True),
        sa.Column('sample', sa.Integer(), primary_key=True),
        sa.Column('job_id', sa.String(length=32), sa.ForeignKey('jobs.id', ondelete='CASCADE'), nullable=False),
        sa.Column('actions', sa.JSON(), nullable=False),
        sa.Column('turns', sa.JSON(), nullable=False),
        sa.Column('done', sa.Boolean(), nullable=False),
        sa.Column('reward', sa.Float(), nullable=True),
        sa.Column('error', sa.String(length=512), nullable=True),
        sa.Column('updated_at', api.models.UTCDateTime(timezone=True), nullable=False),
    )
    op.create_index('ix_episodes_job_id', 'episodes', ['job_id'])


def downgrade() -> None:
    op.drop_index('ix_episodes_job_id', table_name='episodes')
    op.drop_table('episodes')
