"""tinker async: sequences recorded for stable_reinforce (record_stability_info), in-flight samplers and
checkpoints, states stored by the control plane (digest, size), checkpoint expiry (ttl_seconds), and a
sample's prompt tokens in the Tinker ledger (its prefill, for the billing call)

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-27 12:00:00
"""
from alembic import op
import sqlalchemy as sa

import api.models


revision = '0023'
down_revision = '0022'
branch_labels = None
depends_on = None

UTC = api.models.UTCDateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        'tinker_sequences',
        sa.Column('id', sa.String(length=64), nullable=False),
        sa.Column('owner_id', sa.String(length=32), nullable=False),
        sa.Column('model_id', sa.String(length=96), nullable=False),
        sa.Column('prompt', sa.JSON(), nullable=False),
        sa.Column('tokens', sa.JSON(), nullable=False),
        sa.Column('logprobs', sa.JSON(), nullable=False),
        sa.Column('checkpoints', sa.JSON(), nullable=False),
        sa.Column('worker_id', sa.String(length=40), nullable=True),
        sa.Column('created_at', UTC, nullable=False),
        sa.Column('expires_at', UTC, nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_tinker_sequences_owner_id', 'tinker_sequences', ['owner_id'])
    op.create_index('ix_tinker_sequences_expires_at', 'tinker_sequences', ['expires_at'])
    op.add_column('tinker_checkpoints', sa.Column('sha256', sa.String(length=64), nullable=True))
    op.add_column('tinker_checkpoints', sa.Column('size_bytes', sa.BigInteger(), nullable=True))
    op.add_column('tinker_checkpoints', sa.Column('inflight', sa.Boolean(), nullable=False,
                                                  server_default=sa.false()))
    op.add_column('tinker_checkpoints', sa.Column('expires_at', UTC, nullable=True))
    op.create_index('ix_tinker_checkpoints_sha256', 'tinker_checkpoints', ['sha256'])
    op.create_index('ix_tinker_checkpoints_expires_at', 'tinker_checkpoints', ['expires_at'])
    op.add_column('tinker_samplers', sa.Column('inflight', sa.Boolean(), nullable=False, server_default=sa.false()))
    op.add_column('tinker_usage', sa.Column('prompt_tokens', sa.Integer(), nullable=False, server_default='0'))


def downgrade() -> None:
    op.drop_column('tinker_usage', 'prompt_tokens')
    op.drop_column('tinker_samplers', 'inflight')
    op.drop_index('ix_tinker_checkpoints_expires_at', 'tinker_checkpoints')
    op.drop_index('ix_tinker_checkpoints_sha256', 'tinker_checkpoints')
    for column in ('expires_at', 'inflight', 'size_bytes', 'sha256'):
        op.drop_column('tinker_checkpoints', column)
    op.drop_index('ix_tinker_sequences_expires_at', 'tinker_sequences')
    op.drop_index('ix_tinker_sequences_owner_id', 'tinker_sequences')
    op.drop_table('tinker_sequences')
