"""rollout archive: the file holding a finished job's group tokens once they left the table (api/services/archive.py)

Revision ID: 0025
Revises: 0024
Create Date: 2026-11-27 20:30:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0025'
down_revision = '0024'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('rollouts', sa.Column('archive', sa.String(length=128), nullable=True))


def downgrade() -> None:
    _refuse_while_archived()
    op.drop_column('rollouts', 'archive')


def _refuse_while_archived() -> None:
    """An archived row keeps empty token columns and names its file only here: without the column the schema
    before 0025 reads it as a group of no samples, its file named by nothing. The tokens are not put back: their
    files lie under the API's data dir, which a migration is not told, and retention may have deleted them."""
    archived = op.get_bind().scalar(sa.text("SELECT count(*) FROM rollouts WHERE archive IS NOT NULL"))
    if archived:
        raise RuntimeError(
            f"{archived} rollouts are archived: their tokens are in files under data_dir/archive "
            "that only rollouts.archive names (api/services/archive.py), and downgrading past 0025 would drop it, "
            "leaving those groups with no tokens. Downgrade to 0025 at the lowest, or restore a backup of the "
            "database taken before 0025 was applied")
