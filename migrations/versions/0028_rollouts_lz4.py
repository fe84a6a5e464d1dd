"""rollouts' token columns compressed with lz4 on PostgreSQL

A group's samples (8 KB of JSON at G = 8, 64 tokens) are TOASTed and compressed on every insert and
decompressed on every claim; PostgreSQL's default pglz cost about a third of the database's CPU per accepted
group (docs/BENCHMARKS.md "lz4 for the rollouts' tokens"). lz4 compresses a little less (the table holds a
job's queued and newest trained groups; the rest leave for archive files). New values only: old ones keep
pglz and read as before. A server built without lz4 keeps pglz.

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-06 16:10:00
"""
import sqlalchemy as sa
from alembic import op

revision = '0028'
down_revision = '0027'
branch_labels = None
depends_on = None

COLUMNS = ('prompt_token_ids', 'samples', 'rewards', 'learner_logprobs')


def _has_lz4() -> bool:
    bind = op.get_bind()
    return bind.dialect.name == 'postgresql' and bool(bind.execute(sa.text(
        "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'")).scalar())


def _compress(method: str) -> None:
    if _has_lz4():
        for column in COLUMNS:
            op.execute(f'ALTER TABLE rollouts ALTER COLUMN {column} SET COMPRESSION {method}')


def upgrade() -> None:
    _compress('lz4')


def downgrade() -> None:
    _compress('pglz')
