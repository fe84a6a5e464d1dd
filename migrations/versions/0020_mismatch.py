"""per-step mismatch between the behaviour policy and the learner's: KL, ESS, clipped and masked shares, per
staleness (echo2.protocol.MismatchStats)

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-28 10:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0020'
down_revision = '0019'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('step_metrics', sa.Column('mismatch', sa.JSON(), nullable=False, server_default='[]'))


def downgrade() -> None:
    op.drop_column('step_metrics', 'mismatch')
