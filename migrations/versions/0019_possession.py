"""proof of possession: a version's secret probes, and when a worker proved it holds the version

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-28 10:00:00
"""
from alembic import op
import sqlalchemy as sa

import api.models


revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None

UTC = api.models.UTCDateTime(timezone=True)


def upgrade() -> None:
    op.add_column('weight_versions', sa.Column('probes', sa.JSON(none_as_null=True), nullable=True))
    op.add_column('version_holds', sa.Column('proven_at', UTC, nullable=True))


def downgrade() -> None:
    op.drop_column('version_holds', 'proven_at')
    op.drop_column('weight_versions', 'probes')
