"""a sampler checkpoint ends with its session: the rows of the sessions that ended before are deleted (their weights
went with their models, yet the API listed them as kept until deleted)

Revision ID: 0038
Revises: 0037
Create Date: 2026-12-07 23:20:00
"""
import sqlalchemy as sa
from alembic import op


revision = '0038'
down_revision = '0037'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(sa.text("DELETE FROM tinker_checkpoints WHERE kind = 'sampler' AND model_id IN (SELECT m.id FROM "
                       "tinker_models m JOIN tinker_sessions s ON s.id = m.session_id WHERE s.status != 'active')"))


def downgrade() -> None:
    pass  # the deleted rows named weights that no host holds any more: nothing to put back
