"""a Tinker checkpoint is named within its kind: tinker://M/weights/N and tinker://M/sampler_weights/N are two
checkpoints (tinker-cookbook saves both under one name), where the sampler's save overwrote the state's row and
collected its file

Revision ID: 0032
Revises: 0031
Create Date: 2026-12-07 10:00:00
"""
import warnings

import sqlalchemy as sa
from alembic import op


revision = '0032'
down_revision = '0031'
branch_labels = None
depends_on = None


def _primary_key(columns: list[str]) -> None:
    if op.get_bind().dialect.name == 'postgresql':
        op.drop_constraint('tinker_checkpoints_pkey', 'tinker_checkpoints', type_='primary')
        op.create_primary_key('tinker_checkpoints_pkey', 'tinker_checkpoints', columns)
        return
    # SQLite rebuilds the table; SQLAlchemy warns that the reflected columns' primary-key flags differ from the
    # new key, which is the change made here.
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message=".*_alembic_tmp_tinker_checkpoints' specifies columns")
        with op.batch_alter_table('tinker_checkpoints', recreate='always') as batch:
            batch.create_primary_key('tinker_checkpoints_pkey', columns)


def upgrade() -> None:
    _primary_key(['model_id', 'name', 'kind'])


def downgrade() -> None:
    # One row a name again: where a state and a sampler checkpoint share one, the state stays.
    op.execute(sa.text("DELETE FROM tinker_checkpoints WHERE kind = 'sampler' AND EXISTS (SELECT 1 FROM "
                       "tinker_checkpoints t WHERE t.model_id = tinker_checkpoints.model_id AND t.name = "
                       "tinker_checkpoints.name AND t.kind = 'training')"))
    _primary_key(['model_id', 'name'])
