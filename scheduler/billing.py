"""The cost ledger: pay for work, not for claims.

Each tick advances it by the time since the last tick (capped, so scheduler downtime is not billed as if
everything ran):

- a learner is billed its reserved price only while it is alive (heartbeating), so a job whose
  learner crashed or is being relaunched costs nothing meanwhile;
- a worker accrues its active time on each job (at most `pay_window_s` more than what its groups waiting there
  pay for, per job: a job pays only for time spent on it, not for the time before the worker was moved to it;
  and time its groups pay for is kept however long the learner takes to train them), and is paid out
  of it only for rollouts that were worth something: trained, or accepted in time but then not
  trained through the platform's fault (RejectKind.paid: an environment or a reward that failed; not a group
  that went stale before the learner claimed it, which no audit saw: a worker could hold junk back on a lease
  until then). An environment's failure is paid only once a worker of another provider saw the
  environment fail on the same prompt: the group is never audited, and junk actions a worker sends without
  generating make a strict environment fail as surely as an outage does. Each such group buys
  1 / (f · μ_a) seconds, where μ_a is the rate the worker was activated for and f = `pay_rate_fraction`:
  delivering at f · μ_a or better is paid in full, less is paid pro rata, nothing is paid nothing —
  however much a worker claims to be able to do.
  A quarantined or banned worker is paid nothing more.

Every payment is a ledger entry naming the rollouts it pays for, the job's step when it was made, and
what it pays for in words (its memo); job and provider totals are their sums.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime, timedelta

from echo2.protocol import JobStatus, RejectKind, RolloutStatus, TrustState, WorkerStatus
from sqlalchemy import Exists, and_, func, not_, or_, select
from sqlalchemy.orm import Session, aliased

from api.models import Job, LedgerEntry, Provider, Rollout, Worker
from api.services import totals
from api.services.jobs import budget_left, valid_spec
from api.settings import Settings

MIN_MU = 1e-3  # groups/s: a floor for an activation rate that was never measured
PAID_REJECTIONS = [k for k in RejectKind if k.paid() and k is not RejectKind.environment_failed]
WORKING = TrustState.working()


def bill(db: Session, settings: Settings, now: datetime, last: float | None) -> None:
    if last is None:
        return
    seconds = min(max(now.timestamp() - last, 0.0), 10 * settings.reconcile_interval_s)
    _bill_learners(db, settings, now, seconds)
    payable = _payable(db)
    # Locked, in id order, and read afresh: a forfeit committed meanwhile (clawback._forfeit) is not written over.
    active = list(db.scalars(select(Worker).where(Worker.job_id.is_not(None), Worker.status == WorkerStatus.active)
                             .order_by(Worker.id).with_for_update().execution_options(populate_existing=True)))
    queued = _queued(db, active)
    caps = _caps(db, {w.job_id for w in active if w.job_id} | {job for jobs in payable.values() for job in jobs})
    for worker in active:
        assert worker.job_id is not None
        pots = _kept(db, worker)
        # Time its groups will pay for is kept however long they wait to be trained (a slow learner's step).
        waiting = queued.get((worker.id, worker.job_id), 0) + len(payable.get(worker.id, {}).get(worker.job_id, ()))
        window = settings.pay_window_s + waiting * _group_seconds(settings, worker, caps[worker.job_id])
        pots[worker.job_id] = min(pots.get(worker.job_id, 0.0) + seconds, window)
        worker.unbilled = pots
    # A quarantined or banned worker forfeits what it has not been paid yet (api/services/clawback.py).
    for worker in db.scalars(select(Worker).where(Worker.id.in_(payable), Worker.trust.in_(WORKING))
                             .with_for_update()):
        _pay(db, worker, payable[worker.id], lambda job_id, w=worker: _group_seconds(settings, w, caps[job_id]))
        worker.unbilled = _kept(db, worker)


def _kept(db: Session, worker: Worker) -> dict[str, float]:
    """The worker's pots worth keeping: its current job's, and a job's it left while groups it sent there may
    still be paid (not judged or trained yet); time on a job it left is otherwise never paid."""
    pots = {job: s for job, s in (worker.unbilled or {}).items() if s > 0}
    left = [job for job in pots if job != worker.job_id]
    if left:
        waiting = set(db.scalars(select(Rollout.job_id).distinct().where(
            Rollout.worker_id == worker.id, Rollout.job_id.in_(left), Rollout.paid_entry_id.is_(None),
            Rollout.status != RolloutStatus.rejected)))
        pots = {job: s for job, s in pots.items() if job == worker.job_id or job in waiting}
    return pots


def _bill_learners(db: Session, settings: Settings, now: datetime, seconds: float) -> None:
    alive_since = now - timedelta(seconds=settings.learner_dead_after_s)
    # The learner of the current launch, not one that reported its crash: a relaunch loading its model (no beat
    # yet) and a learner dead by its own report were billed on the last beat of the one before.
    current = or_(Job.learner_launched_at.is_(None), Job.learner_heartbeat_at >= Job.learner_launched_at)
    crashed = and_(Job.learner_crashed_at.is_not(None),
                   or_(Job.learner_launched_at.is_(None), Job.learner_crashed_at >= Job.learner_launched_at))
    for job in db.scalars(select(Job).where(Job.status == JobStatus.running, Job.learner_heartbeat_at >= alive_since,
                                            current, not_(crashed))):
        spec = valid_spec(job)
        if spec is None:
            continue  # the tick records why on the job; its learner is billed again once it is mended
        price = spec.learner.price_per_hour or 0.0
        amount = price * seconds / 3600
        totals.add(db, Job.learner_usd, job.id, amount)
        db.add(LedgerEntry(job_id=job.id, kind="learner", amount_usd=amount, seconds=seconds, step=job.step,
                           memo=f"learner reserved {seconds:.1f} s at ${price:.2f}/h"))


def _payable(db: Session) -> dict[str, dict[str, list[tuple[str, bool]]]]:
    """worker -> job -> (id, trained) of its unpaid rollouts that are worth paying for."""
    worth = or_(Rollout.status == RolloutStatus.trained,
                and_(Rollout.status == RolloutStatus.rejected, Rollout.reject_kind.in_(PAID_REJECTIONS)),
                and_(Rollout.reject_kind == RejectKind.environment_failed, _env_failed_elsewhere()))
    rows = db.execute(select(Rollout.worker_id, Rollout.job_id, Rollout.id, Rollout.status)
                      .join(Worker, Worker.id == Rollout.worker_id)
                      .where(Rollout.paid_entry_id.is_(None), worth).order_by(Rollout.created_at))
    out: dict[str, dict[str, list[tuple[str, bool]]]] = defaultdict(lambda: defaultdict(list))
    for worker_id, job_id, rollout_id, status in rows:
        out[worker_id][job_id].append((rollout_id, status == RolloutStatus.trained))
    return out


def _queued(db: Session, workers: list[Worker]) -> dict[tuple[str, str], int]:
    """(worker, job) -> its groups in the job's queue (accepted or claimed, not trained yet), on these workers' jobs:
    read through the queue's index (by worker, a long-lived worker's every group would be read)."""
    jobs = {w.job_id for w in workers if w.job_id}
    if not jobs:
        return {}
    rows = db.execute(select(Rollout.worker_id, Rollout.job_id, func.count())
                      .where(Rollout.job_id.in_(jobs), Rollout.status.in_((RolloutStatus.accepted,
                                                                           RolloutStatus.claimed)))
                      .group_by(Rollout.worker_id, Rollout.job_id))
    return {(worker_id, job_id): n for worker_id, job_id, n in rows}


def _caps(db: Session, job_ids: set[str]) -> dict[str, float | None]:
    """Each job's `workers.max_usd_per_group`, its spec read once a tick."""
    caps: dict[str, float | None] = {}
    for job_id in job_ids:
        job = db.get(Job, job_id)
        spec = valid_spec(job) if job is not None else None
        caps[job_id] = spec.workers.max_usd_per_group if spec is not None else None
    return caps


def _group_seconds(settings: Settings, worker: Worker, cap_usd: float | None) -> float:
    """The active time a group pays for: 1 / (f · μ_a), but at most what the job's cap pays at the worker's price
    (the scheduler lets a worker on trial in on its claimed rate, but its pay is measured against the trial's share
    of the need: one group in its grace paid $27 under a $2 cap)."""
    own = 1.0 / (settings.pay_rate_fraction * max(worker.activated_mu or MIN_MU, MIN_MU))
    return own if cap_usd is None or worker.price_per_hour <= 0 else min(own, cap_usd * 3600 / worker.price_per_hour)


def _env_failed_elsewhere() -> Exists:
    """The environment failed on the rollout's prompt for a worker of another provider too."""
    other, by = aliased(Rollout), aliased(Worker)
    return (select(other.id).join(by, by.id == other.worker_id)
            .where(other.prompt_id == Rollout.prompt_id, other.reject_kind == RejectKind.environment_failed,
                   by.provider_id != Worker.provider_id).exists())


def _pay(db: Session, worker: Worker, by_job: dict[str, list[tuple[str, bool]]],
         group_seconds: Callable[[str], float]) -> None:
    provider = db.get(Provider, worker.provider_id)
    pots = dict(worker.unbilled or {})
    for job_id, payable in by_job.items():
        job = db.get(Job, job_id)
        # The groups what the budget has left pays for are settled, the last of them in part (the job then has
        # spent its budget and pauses); the others wait, with the worker's time in its pot, until the owner
        # raises the budget.
        budget_s, group_s = _budget_left_s(job, worker.price_per_hour), group_seconds(job_id)
        paid = payable if math.isinf(budget_s) else payable[:math.ceil(budget_s / group_s - 1e-9)]
        if not paid:
            continue
        ids = [rollout_id for rollout_id, _ in paid]
        seconds = min(pots.get(job_id, 0.0), len(ids) * group_s, budget_s)
        pots[job_id] = pots.get(job_id, 0.0) - seconds
        amount = worker.price_per_hour * seconds / 3600
        step = job.step if job is not None else None
        entry = LedgerEntry(job_id=job_id, kind="worker", worker_id=worker.id, provider_id=worker.provider_id,
                            amount_usd=amount, seconds=seconds, groups=len(ids), rollout_ids=ids, step=step,
                            memo=_worker_memo(paid, step, seconds, worker.price_per_hour))
        db.add(entry)
        db.flush()
        db.execute(Rollout.__table__.update().where(Rollout.id.in_(ids)).values(paid_entry_id=entry.id))
        totals.add(db, Worker.earned_usd, worker.id, amount)
        if provider is not None:
            totals.add(db, Provider.earnings_usd, provider.id, amount)
        if job is not None:
            totals.add(db, Job.workers_usd, job.id, amount)
    worker.unbilled = pots


def _budget_left_s(job: Job | None, price_per_hour: float) -> float:
    """The active time the job's budget still pays for at this price: a provider's price decides how much one
    tick pays, and a $10,000/h worker's five minutes took $833 of a $1 budget before the tick paused the job.
    A payment settles the groups what is left pays for (the last in part); the others, and the time, wait until
    the owner raises the budget."""
    spec = valid_spec(job) if job is not None else None
    left = budget_left(job, spec) if job is not None and spec is not None else None
    return math.inf if left is None or price_per_hour <= 0 else left * 3600 / price_per_hour


def _worker_memo(paid: list[tuple[str, bool]], step: int | None, seconds: float, price: float) -> str:
    """E.g. "12 groups trained (job step 31), 84 s of active time at $0.05/h"."""
    trained = sum(1 for _, was_trained in paid if was_trained)
    groups = f"{_groups(trained)} trained"
    if trained < len(paid):  # its environment or reward failed: the platform's loss, paid
        groups += f", {_groups(len(paid) - trained)} not trained through the platform's fault"
    return f"{groups} (job step {step}), {seconds:.0f} s of active time at ${price:.2f}/h"


def _groups(n: int) -> str:
    return f"{n} group" if n == 1 else f"{n} groups"
