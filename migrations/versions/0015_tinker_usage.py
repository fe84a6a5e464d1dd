"""tinker usage: the Tinker ledger (one entry per finished request) and each learner host's price

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-25 10:30:00
"""
from alembic import op
import sqlalchemy as sa

import api.models


revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None

UTC = api.models.UTCDateTime(timezone=True)


def upgrade() -> None:
    op.add_column('tinker_hosts', sa.Column('price_per_hour', sa.Float(), nullable=False, server_default='0'))
    op.create_table(
        'tinker_usage',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), primary_key=True),
        sa.Column('owner_id', sa.String(length=32), nullable=False),
        sa.Column('session_id', sa.String(length=40), nullable=False),
        sa.Column('model_id', sa.String(length=96), nullable=False),
        sa.Column('request_id', sa.String(length=40), nullable=False),
        sa.Column('kind', sa.String(length=32), nullable=False),
        sa.Column('host', sa.String(length=128), nullable=False),
        sa.Column('tokens', sa.Integer(), nullable=False),
        sa.Column('seconds', sa.Float(), nullable=False),
        sa.Column('price_per_hour', sa.Float(), nullable=False),
        sa.Column('amount_usd', sa.Float(), nullable=False),
        sa.Column('created_at', UTC, nullable=False),
        sa.UniqueConstraint('request_id'),
    )
    op.create_index('ix_tinker_usage_owner_id', 'tinker_usage', ['owner_id'])
    op.create_index('ix_tinker_usage_session_id', 'tinker_usage', ['session_id'])


def downgrade() -> None:
    op.drop_table('tinker_usage')
    op.drop_column('tinker_hosts', 'price_per_hour')
