"""tinker slots and states: when a Tinker model last took its host slot or gave it up (a busy model gives
its slot up after a while to one that waits, and the model that waited longest takes it), and which host's
disk holds a state saved with save_state

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-25 13:50:00
"""
from alembic import op
import sqlalchemy as sa

import api.models


revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None

UTC = api.models.UTCDateTime(timezone=True)


def upgrade() -> None:
    op.add_column('tinker_models', sa.Column('slot_at', UTC, nullable=True))
    op.add_column('tinker_checkpoints', sa.Column('host', sa.String(length=128), nullable=True))


def downgrade() -> None:
    op.drop_column('tinker_checkpoints', 'host')
    op.drop_column('tinker_models', 'slot_at')
