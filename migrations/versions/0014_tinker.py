"""tinker: the Tinker-compatible surface's sessions, models, checkpoints, samplers, requests (futures), hosts

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-25 08:00:00
"""
from alembic import op
import sqlalchemy as sa

import api.models


revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None

UTC = api.models.UTCDateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        'tinker_sessions',
        sa.Column('id', sa.String(length=40), primary_key=True),
        sa.Column('owner_id', sa.String(length=32), sa.ForeignKey('users.id', ondelete='CASCADE'), nullable=False),
        sa.Column('sdk_version', sa.String(length=32), nullable=False),
        sa.Column('tags', sa.JSON(), nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('finish_reason', sa.String(length=16), nullable=True),
        sa.Column('heartbeat_at', UTC, nullable=False),
        sa.Column('created_at', UTC, nullable=False),
        sa.Column('finished_at', UTC, nullable=True),
    )
    op.create_index('ix_tinker_sessions_owner_id', 'tinker_sessions', ['owner_id'])
    op.create_table(
        'tinker_models',
        sa.Column('id', sa.String(length=96), primary_key=True),
        sa.Column('session_id', sa.String(length=40), sa.ForeignKey('tinker_sessions.id', ondelete='CASCADE'),
                  nullable=False),
        sa.Column('owner_id', sa.String(length=32), nullable=False),
        sa.Column('kind', sa.String(length=16), nullable=False),
        sa.Column('base_model', sa.String(length=512), nullable=False),
        sa.Column('lora', sa.JSON(none_as_null=True), nullable=True),
        sa.Column('host', sa.String(length=128), nullable=True),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('error', sa.String(length=1024), nullable=True),
        sa.Column('info', sa.JSON(), nullable=False),
        sa.Column('created_at', UTC, nullable=False),
    )
    for column in ('session_id', 'owner_id', 'host'):
        op.create_index(f'ix_tinker_models_{column}', 'tinker_models', [column])
    op.create_table(
        'tinker_checkpoints',
        sa.Column('model_id', sa.String(length=96), sa.ForeignKey('tinker_models.id', ondelete='CASCADE'),
                  primary_key=True),
        sa.Column('name', sa.String(length=128), primary_key=True),
        sa.Column('kind', sa.String(length=16), nullable=False),
        sa.Column('step', sa.Integer(), nullable=False),
        sa.Column('created_at', UTC, nullable=False),
    )
    op.create_table(
        'tinker_samplers',
        sa.Column('id', sa.String(length=128), primary_key=True),
        sa.Column('session_id', sa.String(length=40), sa.ForeignKey('tinker_sessions.id', ondelete='CASCADE'),
                  nullable=False),
        sa.Column('owner_id', sa.String(length=32), nullable=False),
        sa.Column('model_id', sa.String(length=96), sa.ForeignKey('tinker_models.id', ondelete='CASCADE'),
                  nullable=False),
        sa.Column('checkpoint', sa.String(length=128), nullable=True),
        sa.Column('base_model', sa.String(length=512), nullable=False),
        sa.Column('model_path', sa.String(length=512), nullable=True),
        sa.Column('created_at', UTC, nullable=False),
    )
    op.create_index('ix_tinker_samplers_session_id', 'tinker_samplers', ['session_id'])
    op.create_index('ix_tinker_samplers_owner_id', 'tinker_samplers', ['owner_id'])
    op.create_table(
        'tinker_requests',
        sa.Column('id', sa.String(length=40), primary_key=True),
        sa.Column('owner_id', sa.String(length=32), nullable=False),
        sa.Column('model_id', sa.String(length=96), sa.ForeignKey('tinker_models.id', ondelete='CASCADE'),
                  nullable=False),
        sa.Column('kind', sa.String(length=32), nullable=False),
        sa.Column('seq', sa.Integer(), nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('payload', sa.JSON(), nullable=False),
        sa.Column('result', sa.JSON(none_as_null=True), nullable=True),
        sa.Column('error', sa.String(length=1024), nullable=True),
        sa.Column('category', sa.String(length=16), nullable=True),
        sa.Column('idempotency_key', sa.String(length=128), nullable=True),
        sa.Column('created_at', UTC, nullable=False),
        sa.Column('started_at', UTC, nullable=True),
        sa.Column('finished_at', UTC, nullable=True),
        sa.UniqueConstraint('owner_id', 'idempotency_key'),
        sa.UniqueConstraint('model_id', 'seq'),
    )
    op.create_index('ix_tinker_requests_owner_id', 'tinker_requests', ['owner_id'])
    op.create_index('ix_tinker_requests_queue', 'tinker_requests', ['model_id', 'status', 'seq'])
    op.create_table(
        'tinker_hosts',
        sa.Column('name', sa.String(length=128), primary_key=True),
        sa.Column('slots', sa.Integer(), nullable=False),
        sa.Column('seen_at', UTC, nullable=False),
    )


def downgrade() -> None:
    for table in ('tinker_hosts', 'tinker_requests', 'tinker_samplers', 'tinker_checkpoints', 'tinker_models',
                  'tinker_sessions'):
        op.drop_table(table)
