"""Running money totals (a job's learner and worker costs, a worker's and a provider's earnings), added to in the
database itself. The rows that a payment or a clawback changes are read by requests and ticks that do not all
lock them: a clawback during a billing tick wrote back the job's cost and the provider's earnings as it had read
them before the tick committed, and the tick's payments vanished from both (the ledger kept them)."""

from __future__ import annotations

from sqlalchemy import update
from sqlalchemy.orm import InstrumentedAttribute, Session


def add(db: Session, total: InstrumentedAttribute[float], row_id: str, amount: float) -> None:
    """total += amount on one row, atomically; the row in the session reads the new value."""
    model = total.class_
    db.execute(update(model).where(model.id == row_id).values({total.key: total + amount})
               .execution_options(synchronize_session="fetch"))
