"""a job's model context length, read from its first published version's config.json like its vocabulary size: a
vLLM worker stops a sample where the context ends, before max_new_tokens, and the door took that for a forgery

Revision ID: 0036
Revises: 0035
Create Date: 2026-12-07 17:50:00
"""
import sqlalchemy as sa
from alembic import op


revision = '0036'
down_revision = '0035'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('jobs', sa.Column('context_length', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch_op:
        batch_op.drop_column('context_length')
