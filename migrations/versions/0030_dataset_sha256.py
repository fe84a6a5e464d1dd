"""datasets remember the sha256 of the file they were uploaded from in parts, so the same upload run again (to
resume it) after it completed names the dataset it made instead of making a second one

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-07 05:10:00
"""
import sqlalchemy as sa
from alembic import op

revision = '0030'
down_revision = '0029'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('datasets', schema=None) as batch_op:
        batch_op.add_column(sa.Column('sha256', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('datasets', schema=None) as batch_op:
        batch_op.drop_column('sha256')
