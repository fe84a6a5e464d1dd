"""rollouts whose environment failed, by prompt: a prompt is set aside, and such a group paid, only when workers of
two providers saw its environment fail

Revision ID: 0031
Revises: 0030
Create Date: 2026-12-07 07:00:00
"""
import sqlalchemy as sa
from alembic import op


revision = '0031'
down_revision = '0030'
branch_labels = None
depends_on = None
ENV_FAILED = sa.text("reject_kind = 'environment_failed'")


def upgrade() -> None:
    op.create_index('ix_rollouts_env_failed', 'rollouts', ['prompt_id'], unique=False,
                    postgresql_where=ENV_FAILED, sqlite_where=ENV_FAILED)


def downgrade() -> None:
    op.drop_index('ix_rollouts_env_failed', table_name='rollouts')
