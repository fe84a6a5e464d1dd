"""a worker's active time waiting for pay is kept per job: one pot for all jobs made the first groups a worker
delivered on a job it was moved to pay for the time it spent on the job before (another tenant's)

Revision ID: 0033
Revises: 0032
Create Date: 2026-12-07 10:30:00
"""
import json

import sqlalchemy as sa
from alembic import op


revision = '0033'
down_revision = '0032'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('workers', sa.Column('unbilled', sa.JSON(), nullable=False, server_default='{}'))
    bind = op.get_bind()
    # What waited was the current job's time, or, for a worker off any job, its newest group's job's.
    rows = bind.execute(sa.text("SELECT id, COALESCE(job_id, (SELECT r.job_id FROM rollouts r WHERE r.worker_id = "
                                "workers.id ORDER BY r.created_at DESC LIMIT 1)), unbilled_s FROM workers WHERE "
                                "unbilled_s > 0")).all()
    for worker_id, job_id, seconds in rows:
        if job_id is None:
            continue
        bind.execute(sa.text("UPDATE workers SET unbilled = :pots WHERE id = :id"),
                     {"pots": json.dumps({job_id: seconds}), "id": worker_id})
    with op.batch_alter_table('workers') as batch_op:
        batch_op.drop_column('unbilled_s')


def downgrade() -> None:
    with op.batch_alter_table('workers') as batch_op:
        batch_op.add_column(sa.Column('unbilled_s', sa.Float(), nullable=False, server_default='0'))
    bind = op.get_bind()
    for worker_id, pots in bind.execute(sa.text("SELECT id, unbilled FROM workers")).all():
        pots = json.loads(pots) if isinstance(pots, str) else pots
        if pots:
            bind.execute(sa.text("UPDATE workers SET unbilled_s = :s WHERE id = :id"),
                         {"s": sum(pots.values()), "id": worker_id})
    with op.batch_alter_table('workers') as batch_op:
        batch_op.drop_column('unbilled')
