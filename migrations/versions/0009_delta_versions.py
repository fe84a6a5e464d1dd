"""delta versions: a version may be published in full (a keyframe), as a delta against the version before
it, or both; the full form's columns become nullable; a LoRA adapter version names its base

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24 16:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('weight_versions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('delta_manifest', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('delta_size', sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column('delta_base', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('adapter_base', sa.Integer(), nullable=True))
        batch_op.alter_column('manifest', existing_type=sa.JSON(), nullable=True)
        batch_op.alter_column('manifest_sha256', existing_type=sa.String(length=64), nullable=True)
        batch_op.alter_column('total_size', existing_type=sa.BigInteger(), nullable=True)
        batch_op.alter_column('num_chunks', existing_type=sa.Integer(), nullable=True)


def downgrade() -> None:
    op.execute("DELETE FROM weight_versions WHERE manifest IS NULL")
    with op.batch_alter_table('weight_versions', schema=None) as batch_op:
        batch_op.alter_column('num_chunks', existing_type=sa.Integer(), nullable=False)
        batch_op.alter_column('total_size', existing_type=sa.BigInteger(), nullable=False)
        batch_op.alter_column('manifest_sha256', existing_type=sa.String(length=64), nullable=False)
        batch_op.alter_column('manifest', existing_type=sa.JSON(), nullable=False)
        batch_op.drop_column('adapter_base')
        batch_op.drop_column('delta_base')
        batch_op.drop_column('delta_size')
        batch_op.drop_column('delta_manifest')
