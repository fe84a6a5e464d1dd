"""learner hosts with several GPUs: each host's GPUs (a slot a GPU), where a job's learner was placed, and
the memory each of its GPUs needs

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-28 12:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0021'
down_revision = '0020'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('learner_hosts') as batch:
        batch.add_column(sa.Column('gpus', sa.JSON(), nullable=True))
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('learner_memory_gib', sa.Float(), nullable=True))
        batch.add_column(sa.Column('learner_placement', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('learner_placement')
        batch.drop_column('learner_memory_gib')
    with op.batch_alter_table('learner_hosts') as batch:
        batch.drop_column('gpus')
