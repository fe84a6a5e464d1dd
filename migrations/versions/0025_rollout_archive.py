"""rollout archive: the file holding a finished job's group tokens once they left the table (api/services/archive.py)

Revision ID: 0025
Revises: 0024
Create Date: 2026-11-27 20:30:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0025'
down_revision = '0024'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('rollouts', sa.Column('archive', sa.String(length=128), nullable=True))


def downgrade() -> None:
    op.drop_column('rollouts', 'archive')
