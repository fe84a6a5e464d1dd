"""replay and accountability: a rollout keeps the seed it was leased with, the precision its worker computed in,
and what the door found suspicious about it; payments can be clawed back; providers answer for their workers

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-27 10:00:00
"""
from alembic import op
import sqlalchemy as sa

import api.models


revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None

UTC = api.models.UTCDateTime(timezone=True)


def upgrade() -> None:
    op.add_column('rollouts', sa.Column('seed', sa.BigInteger(), nullable=True))
    op.add_column('rollouts', sa.Column('precision', sa.String(length=16), nullable=True))
    op.add_column('rollouts', sa.Column('suspicion', sa.String(length=64), nullable=True))
    op.add_column('ledger_entries', sa.Column('clawed_back_by', sa.BigInteger(), nullable=True))
    op.add_column('workers', sa.Column('evidence', sa.JSON(), nullable=False, server_default='{}'))
    op.add_column('providers', sa.Column('watch_until', UTC, nullable=True))
    op.add_column('providers', sa.Column('banned_at', UTC, nullable=True))
    op.add_column('providers', sa.Column('standing_reason', sa.String(length=512), nullable=True))


def downgrade() -> None:
    for column in ('standing_reason', 'banned_at', 'watch_until'):
        op.drop_column('providers', column)
    op.drop_column('workers', 'evidence')
    op.drop_column('ledger_entries', 'clawed_back_by')
    for column in ('suspicion', 'precision', 'seed'):
        op.drop_column('rollouts', column)
