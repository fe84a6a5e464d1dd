"""a worker registered by a provider whose worker left with strikes starts with them: which worker it took them from,
so that its quarantine claws back that one's pay too (api/services/trust.py::inherit_strikes)

Revision ID: 0035
Revises: 0034
Create Date: 2026-12-07 17:10:00
"""
import sqlalchemy as sa
from alembic import op


revision = '0035'
down_revision = '0034'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('workers', sa.Column('inherited_from', sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('workers') as batch_op:
        batch_op.drop_column('inherited_from')
