"""Rollout admission. A group made with version x is trainable at learner step t only if t - x <= S;
this is checked when a worker submits and again when the learner claims. Rejected groups keep their
row (with the reason) and their prompt goes back to the pool: nothing is lost."""

from __future__ import annotations

from typing import Any

from echo2.protocol import GroupResult, GroupSubmit, RolloutStatus
from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

from ..models import Job, Lease, Prompt, Rollout, Worker, new_id, utcnow
from .jobs import spec_of
from .pool import return_prompts


def submit_groups(db: Session, job: Job, lease: Lease, worker: Worker, groups: list[GroupSubmit]) -> list[GroupResult]:
    spec = spec_of(job)
    existing = {
        r.prompt_id: r
        for r in db.scalars(select(Rollout).where(Rollout.lease_id == lease.id,
                                                  Rollout.prompt_id.in_([g.prompt_id for g in groups])))
    }
    in_lease = set(lease.prompt_ids)
    results: list[GroupResult] = []
    rows: list[dict[str, Any]] = []
    back_to_pool: list[int] = []
    for group in groups:
        if group.prompt_id in existing:  # idempotent per (lease, prompt): replay the first answer
            r = existing[group.prompt_id]
            results.append(GroupResult(prompt_id=r.prompt_id, rollout_id=r.id, status=r.status, reason=r.reason))
            continue
        if group.prompt_id not in in_lease:
            results.append(GroupResult(prompt_id=group.prompt_id, rollout_id=None, status=RolloutStatus.rejected,
                                       reason="prompt is not part of this lease"))
            continue
        reason = _rejection(job, lease, group, spec.staleness, spec.grpo.group_size)
        row = _row(job, lease, worker, group, reason)
        rows.append(row)
        existing[group.prompt_id] = Rollout(**row)
        if reason:
            back_to_pool.append(group.prompt_id)
        results.append(GroupResult(prompt_id=group.prompt_id, rollout_id=row["id"], status=row["status"],
                                   reason=reason))
    _store(db, lease, worker, rows, back_to_pool)
    return results


def _rejection(job: Job, lease: Lease, group: GroupSubmit, staleness: int, group_size: int) -> str | None:
    if lease.status != "active":
        return f"lease is {lease.status}"
    if group.version != lease.version:
        return f"version {group.version} differs from the leased version {lease.version}"
    if job.version is None or group.version > job.version:
        return f"version {group.version} was never published"
    if job.step - group.version > staleness:
        return f"stale: step {job.step} - version {group.version} > S={staleness}"
    if len(group.samples) != group_size:
        return f"group has {len(group.samples)} samples, the job's group size is {group_size}"
    return None


def _row(job: Job, lease: Lease, worker: Worker, group: GroupSubmit, reason: str | None) -> dict[str, Any]:
    return {
        "id": new_id("rol"), "job_id": job.id, "prompt_id": group.prompt_id, "lease_id": lease.id,
        "worker_id": worker.id, "version": group.version,
        "status": RolloutStatus.rejected.value if reason else RolloutStatus.accepted.value, "reason": reason,
        "prompt_token_ids": group.prompt_token_ids,
        "samples": [s.model_dump(mode="json") for s in group.samples], "gen_seconds": group.gen_seconds,
    }


def _store(db: Session, lease: Lease, worker: Worker, rows: list[dict[str, Any]], back: list[int]) -> None:
    if rows:
        db.execute(insert(Rollout), rows)
    accepted = [r["prompt_id"] for r in rows if r["status"] == RolloutStatus.accepted.value]
    if accepted:
        db.execute(update(Prompt).where(Prompt.id.in_(accepted), Prompt.lease_id == lease.id)
                   .values(state="submitted"))
    return_prompts(db, back, lease_id=lease.id)
    worker.accepted_rollouts += len(accepted)
    worker.rejected_rollouts += len(rows) - len(accepted)
    if lease.status == "active" and _all_answered(db, lease):
        lease.status, lease.finished_at = "completed", utcnow()


def _all_answered(db: Session, lease: Lease) -> bool:
    answered = db.scalar(select(func.count()).where(Rollout.lease_id == lease.id))
    return answered >= len(lease.prompt_ids)


def reject_stale(db: Session, job: Job, step: int, staleness: int) -> int:
    """Queued groups too old for step t are rejected and their prompts re-pooled."""
    stale = list(db.scalars(
        select(Rollout).where(Rollout.job_id == job.id, Rollout.status == "accepted",
                              Rollout.version < step - staleness).with_for_update(skip_locked=True)
    ))
    for r in stale:
        r.status, r.reason = "rejected", f"stale at claim: step {step} - version {r.version} > S={staleness}"
    return_prompts(db, [r.prompt_id for r in stale], from_state="submitted")
    return len(stale)


def claim(db: Session, job: Job, step: int, max_groups: int) -> tuple[list[Rollout], int]:
    spec = spec_of(job)
    rejected = reject_stale(db, job, step, spec.staleness)
    query = (
        select(Rollout)
        .where(Rollout.job_id == job.id, Rollout.status == "accepted")
        .order_by(Rollout.created_at, Rollout.id)
        .limit(max_groups)
        .with_for_update(skip_locked=True)
    )
    rows = list(db.scalars(query))
    for r in rows:
        r.status, r.claim_step = "claimed", step
    return rows, rejected


def release_claims(db: Session, job_id: str, step: int | None = None) -> int:
    """Claimed rollouts not committed by a step go back to the queue (re-checked for staleness)."""
    query = update(Rollout).where(Rollout.job_id == job_id, Rollout.status == "claimed")
    if step is not None:
        query = query.where(Rollout.claim_step == step)
    return db.execute(query.values(status="accepted", claim_step=None)).rowcount or 0


def prompts_by_id(db: Session, ids: list[int]) -> dict[int, Prompt]:
    return {p.id: p for p in db.scalars(select(Prompt).where(Prompt.id.in_(ids)))}
