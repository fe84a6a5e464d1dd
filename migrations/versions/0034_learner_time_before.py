"""a job's learner time counts every learner it had: each learner process reports its own busy and wall seconds
since it started, which overwrote the job's, so a job resumed after its budget (or relaunched after a crash)
reported only its newest learner's

Revision ID: 0034
Revises: 0033
Create Date: 2026-12-07 11:00:00
"""
import sqlalchemy as sa
from alembic import op


revision = '0034'
down_revision = '0033'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('jobs', sa.Column('learner_busy_before_s', sa.Float(), nullable=False, server_default='0'))
    op.add_column('jobs', sa.Column('learner_wall_before_s', sa.Float(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch_op:
        batch_op.drop_column('learner_wall_before_s')
        batch_op.drop_column('learner_busy_before_s')
