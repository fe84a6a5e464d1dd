"""tinker fleet: a Tinker model's fleet sampler is a job (its versions the model's sampler checkpoints); its
prompts are sample requests, with their tokens, their own sampling, the version they must be drawn with and
the request they answer

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-25 16:45:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('jobs', sa.Column('tinker_model_id', sa.String(length=96), nullable=True))
    op.create_index('ix_jobs_tinker_model_id', 'jobs', ['tinker_model_id'])
    op.add_column('prompts', sa.Column('token_ids', sa.JSON(), nullable=True))
    op.add_column('prompts', sa.Column('sampling', sa.JSON(), nullable=True))
    op.add_column('prompts', sa.Column('version', sa.Integer(), nullable=True))
    op.add_column('prompts', sa.Column('request_id', sa.String(length=40), nullable=True))
    op.create_index('ix_prompts_request_id', 'prompts', ['request_id'])
    op.add_column('tinker_checkpoints', sa.Column('version', sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column('tinker_checkpoints', 'version')
    op.drop_index('ix_prompts_request_id', 'prompts')
    for column in ('request_id', 'version', 'sampling', 'token_ids'):
        op.drop_column('prompts', column)
    op.drop_index('ix_jobs_tinker_model_id', 'jobs')
    op.drop_column('jobs', 'tinker_model_id')
