"""job kind: a job says what trains it (grpo: its own learner; tinker_fleet: a Tinker model's fleet sampler)

Revision ID: 0024
Revises: 0023
Create Date: 2026-11-27 17:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0024'
down_revision = '0023'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('jobs', sa.Column('kind', sa.String(length=16), nullable=False, server_default='grpo'))
    op.execute("UPDATE jobs SET kind = 'tinker_fleet' WHERE tinker_model_id IS NOT NULL")


def downgrade() -> None:
    op.drop_column('jobs', 'kind')
