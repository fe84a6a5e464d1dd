"""a user's workflow: groups the task could not score (counted on the job until it pauses, per step), the
learner's own logprob of each trained token (rollout traces), each held-out prompt's greedy answer, the chat
context of a prompt, and resumable dataset uploads

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-27 12:00:00
"""
from alembic import op
import sqlalchemy as sa

import api.models


revision = '0022'
down_revision = '0021'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch_op:
        batch_op.add_column(sa.Column('reward_failures', sa.Integer(), nullable=False, server_default='0'))
    with op.batch_alter_table('step_metrics') as batch_op:
        batch_op.add_column(sa.Column('groups_unscored', sa.Integer(), nullable=False, server_default='0'))
    op.add_column('rollouts', sa.Column('learner_logprobs', sa.JSON(), nullable=True))
    op.add_column('eval_results', sa.Column('greedy_answers', sa.JSON(), nullable=True))
    op.add_column('prompts', sa.Column('context', sa.JSON(), nullable=True))
    op.create_table(
        'dataset_uploads',
        sa.Column('id', sa.String(length=32), nullable=False),
        sa.Column('owner_id', sa.String(length=32), nullable=False),
        sa.Column('name', sa.String(length=128), nullable=False),
        sa.Column('size', sa.BigInteger(), nullable=False),
        sa.Column('sha256', sa.String(length=64), nullable=False),
        sa.Column('part_size', sa.Integer(), nullable=False),
        sa.Column('created_at', api.models.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['owner_id'], ['users.id']),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_dataset_uploads_owner_id', 'dataset_uploads', ['owner_id'])


def downgrade() -> None:
    op.drop_index('ix_dataset_uploads_owner_id', 'dataset_uploads')
    op.drop_table('dataset_uploads')
    op.drop_column('prompts', 'context')
    op.drop_column('eval_results', 'greedy_answers')
    op.drop_column('rollouts', 'learner_logprobs')
    with op.batch_alter_table('step_metrics') as batch_op:
        batch_op.drop_column('groups_unscored')
    with op.batch_alter_table('jobs') as batch_op:
        batch_op.drop_column('reward_failures')
