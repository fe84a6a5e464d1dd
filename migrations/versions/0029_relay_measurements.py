"""relay upload rates measured per provider: a relay's rate is the median over the providers whose workers
downloaded from it, so one provider's invented measurements cannot move it alone

Revision ID: 0029
Revises: 0028
Create Date: 2026-12-07 05:00:00
"""
import sqlalchemy as sa
from alembic import op

import api.models

revision = '0029'
down_revision = '0028'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'relay_measurements',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
        sa.Column('relay_worker_id', sa.String(length=32), nullable=False),
        sa.Column('provider_id', sa.String(length=32), nullable=False),
        sa.Column('mbps', sa.Float(), nullable=False),
        sa.Column('measured_at', api.models.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('relay_worker_id', 'provider_id'),
    )
    op.create_index('ix_relay_measurements_relay_worker_id', 'relay_measurements', ['relay_worker_id'])


def downgrade() -> None:
    op.drop_index('ix_relay_measurements_relay_worker_id', table_name='relay_measurements')
    op.drop_table('relay_measurements')
