"""What one tenant may read of text the platform wrote about several: the scheduler's lines and triggers, and a
worker's latest evidence, name other tenants' jobs and rollouts. A user reads them with those ids replaced."""

from __future__ import annotations

import re

from sqlalchemy import select
from sqlalchemy.orm import Session

from ..models import Job

JOB_ID = re.compile(r"\bjob_[0-9a-f]{16}\b")
ROLLOUT_ID = re.compile(r"\brol_[0-9a-f]{16}\b")


def own_jobs(db: Session, user_id: str) -> set[str]:
    return set(db.scalars(select(Job.id).where(Job.owner_id == user_id)))


def redact(text: str | None, own: set[str], *, rollouts: bool = False) -> str | None:
    """`text` with every job id not in `own` read as "another job" (and, with `rollouts`, every rollout id as
    "a rollout": which job one is of is not in the text)."""
    if text is None:
        return None
    text = JOB_ID.sub(lambda m: m.group(0) if m.group(0) in own else "another job", text)
    return ROLLOUT_ID.sub("a rollout", text) if rollouts else text
