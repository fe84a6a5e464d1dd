"""The prompt pool: server-chosen leases, renewals, expiry and returning prompts. Nothing is lost:
every prompt is always available, leased, submitted or trained."""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from echo2.protocol import JobSpec, JobStatus, LeaseStatus, PromptState, RejectKind, RolloutStatus, TrustState
from echo2.seeds import order_key, prompt_seed
from sqlalchemy import and_, case, func, select, update
from sqlalchemy.orm import Session

from ..db import WRITER_LOCK
from ..errors import ApiError
from ..models import Episode, Job, Lease, Prompt, Rollout, StepMetric, Worker, utcnow
from ..settings import Settings
from . import possession
from .jobs import finish_job, spec_of

STARVING = 3  # returns after which a prompt is leased before the rest of its epoch
ENV_FAILURES = 3  # environment failures after which a prompt is set aside for the rest of the job
FRONT = 2**31  # order keys are in [0, 2**31): subtracting this puts a prompt before all of them
UNJUDGED = 8  # groups a worker on probation or suspect may have waiting for their audit (one lease's worth)
UNJUDGED_ANY = 2**31
IDLE_CHAIN = 32  # a worker's latest leases (and groups) the lease idle rule looks back over
# Groups that count as delivered (the scheduler's mu, the lease idle rule): not a worker's fault, and not late
# either: a group that arrives after its lease ended or once stale is of no use to the job (and a worker could
# release leases and answer them at will). Nor one whose episodes broke the environment: the worker chose the
# actions (nonsense ones count as its speed). Nor one that went stale unclaimed (unpaid: RejectKind.paid).
UNDELIVERED = [k for k in RejectKind if not k.paid()] + [RejectKind.environment_failed]
DELIVERED = Rollout.reject_kind.is_(None) | Rollout.reject_kind.not_in(UNDELIVERED)
IDLE_PATIENCE = 3.0  # a lease may go this many times its generation at the worker's pace without a group


def return_prompts(db: Session, prompt_ids: list[int], lease_id: str | None = None,
                   from_state: str = "leased") -> int:
    """Put prompts back into the pool (one more attempt each): by default leased ones that got no
    accepted rollout; `from_state="submitted"` for ones whose queued rollout was rejected later.
    A prompt returned STARVING times goes first: its order key drops below every other of its epoch,
    so no prompt waits behind the pool forever."""
    if not prompt_ids:
        return 0
    query = update(Prompt).where(Prompt.id.in_(prompt_ids), Prompt.state == from_state)
    if lease_id is not None:
        query = query.where(Prompt.lease_id == lease_id)
    starving = case((and_(Prompt.attempts + 1 >= STARVING, Prompt.order_key >= 0), Prompt.order_key - FRONT),
                    else_=Prompt.order_key)
    result = db.execute(query.values(state=PromptState.available, lease_id=None, attempts=Prompt.attempts + 1,
                                     order_key=starving))
    return result.rowcount or 0


def set_aside_failing(db: Session, job_id: str, prompt_ids: list[int]) -> int:
    """A prompt whose environment failed ENV_FAILURES times leaves the pool: returned, it would be leased
    again and again (first, once starving) while the job's other prompts wait. The failures must come
    from workers of two providers when the job has had two, so one provider sending actions that break the
    environment (from as many workers as it likes) cannot empty the pool alone. The job fails, saying why,
    when fewer prompts are left than a step takes. Returns how many prompts were set aside."""
    if not prompt_ids:
        return 0
    fleet = db.scalar(select(func.count(Worker.provider_id.distinct())).join(Lease, Lease.worker_id == Worker.id)
                      .where(Lease.job_id == job_id)) or 1
    failures = (select(Rollout.prompt_id).join(Worker, Worker.id == Rollout.worker_id)
                .where(Rollout.prompt_id.in_(prompt_ids), Rollout.reject_kind == RejectKind.environment_failed)
                .group_by(Rollout.prompt_id)
                .having(func.count() >= ENV_FAILURES, func.count(Worker.provider_id.distinct()) >= min(fleet, 2)))
    result = db.execute(update(Prompt).where(Prompt.id.in_(failures), Prompt.state == PromptState.available)
                        .values(state=PromptState.set_aside))
    if result.rowcount:
        _fail_if_starved(db, db.get(Job, job_id))
    return result.rowcount or 0


def _fail_if_starved(db: Session, job: Job) -> None:
    left = db.scalar(select(func.count()).where(Prompt.job_id == job.id,
                                                Prompt.state.not_in([PromptState.set_aside, PromptState.eval])))
    need = spec_of(job).grpo.prompts_per_step
    if left < need and not job.status.is_terminal():
        finish_job(db, job, JobStatus.failed,
                   f"only {left} prompts are left, a step takes {need}: the environment failed "
                   f"{ENV_FAILURES} times on each of the others (GET /v1/jobs/{job.id}/rollouts shows why)")


def end_lease(db: Session, lease: Lease, status: LeaseStatus) -> int:
    """Close a lease; its prompts that got no rollout go back to the pool. Returns how many did."""
    lease.status, lease.finished_at = status, utcnow()
    return return_prompts(db, list(lease.prompt_ids), lease_id=lease.id)


def expire_leases(db: Session, now: datetime | None = None, job_id: str | None = None) -> int:
    """Expire active leases past their deadline. Returns the number of prompts returned."""
    now = now or utcnow()
    query = select(Lease).where(Lease.status == LeaseStatus.active, Lease.expires_at < now)
    if job_id is not None:
        query = query.where(Lease.job_id == job_id)
    leases = db.scalars(query.with_for_update(skip_locked=True))
    return sum(end_lease(db, lease, LeaseStatus.expired) for lease in leases)


def create_lease(db: Session, job: Job, worker: Worker, max_prompts: int, version: int, ttl_s: float
                 ) -> tuple[Lease, list[Prompt]]:
    """A new lease and its prompts, in the order they were chosen (the lease's order)."""
    spec = spec_of(job)
    _check_version(db, job, worker, version, spec)
    expire_leases(db, job_id=job.id)
    db.execute(select(Job.id).where(Job.id == job.id).with_for_update(**WRITER_LOCK))  # room counted per job, exactly
    room = lease_room(db, job, spec, version)
    if room <= 0:
        wait = _step_period_s(db, job)
        raise ApiError(409, f"no room: the groups queued and in flight already cover what the learner can train "
                       f"before version {version} goes stale (S={spec.staleness}); retry after its next step",
                       headers=_retry_after(wait))
    room = min(room, _unjudged_room(db, worker))
    chosen = _take_available(db, job, min(max_prompts, room), version)
    if not chosen and job.kind.has_task and _start_next_epoch(db, job, spec.seed):
        chosen = _take_available(db, job, min(max_prompts, room), version)
    if not chosen:
        raise ApiError(409, "no prompts available right now: all are leased or awaiting training; retry later",
                       headers=_retry_after(_step_period_s(db, job)))
    lease = Lease(job_id=job.id, worker_id=worker.id, version=version, step_at_lease=job.step,
                  prompt_ids=[p.id for p in chosen], expires_at=utcnow() + timedelta(seconds=ttl_s))
    db.add(lease)
    db.flush()
    db.execute(update(Prompt).where(Prompt.id.in_(lease.prompt_ids))
               .values(state=PromptState.leased, lease_id=lease.id))
    return lease, chosen


def idle_past_bound(db: Session, worker: Worker, start: datetime, more: int, settings: Settings) -> float | None:
    """Seconds the worker has held prompts without working them, up to `start` (its lease's grant, or now for a lease
    it asks for), where that is more than it may: `lease_idle_s`, and IDLE_PATIENCE times what the prompts its
    leases hold, and `more` it asks for, take it at its pace (a prefetched lease waits while the worker generates
    the one before it). None while it is not: prompts held and not generated keep every other worker from them."""
    idle = idle_seconds(db, worker.id, start, settings.lease_ttl_s)
    if idle <= settings.lease_idle_s or idle <= _generation_bound_s(db, worker, holding(db, worker) + more):
        return None
    return idle


def generating(db: Session, worker: Worker, now: datetime, settings: Settings) -> bool:
    """The worker holds prompts, for no longer than IDLE_PATIENCE times what they take it at its pace (its claimed
    rate before it delivered: a CPU worker's first lease takes longer than the delivery grace)."""
    held = holding(db, worker)
    return held > 0 and idle_seconds(db, worker.id, now, settings.lease_ttl_s, now) <= _generation_bound_s(
        db, worker, held)


def idle_seconds(db: Session, worker_id: str, start: datetime, ttl_s: float, now: datetime | None = None) -> float:
    """Back from `start` through the leases the worker held one after another (each granted within a lease TTL of the
    end of the one before) to its last group worth something to its job (late junk on a released lease reset the
    clock of a hoard, and kept a trial that never delivered alive) or episode turn (a multi-turn lease sends its
    groups once its episodes end), or to the first of them: a worker that releases its idle lease and leases all
    again is as idle as one that renews."""
    last_group = select(func.max(Rollout.created_at)).where(Rollout.lease_id == Lease.id, DELIVERED).scalar_subquery()
    last_turn = select(func.max(Episode.updated_at)).where(Episode.lease_id == Lease.id).scalar_subquery()
    query = select(Lease.created_at, func.coalesce(Lease.finished_at, Lease.expires_at), last_group, last_turn) \
        .where(Lease.worker_id == worker_id, Lease.created_at <= start).order_by(Lease.created_at.desc())
    for limit in (2, IDLE_CHAIN):  # a working worker's last two leases tell: the rest is read for an idle one only
        since, decided = start, False
        rows = db.execute(query.limit(limit)).all()
        for created, until, *worked in rows:
            if until < since - timedelta(seconds=ttl_s):
                decided = True  # not held one after another: the worker held nothing meanwhile
                break
            if any(worked):
                since, decided = max(t for t in worked if t is not None), True
                break
            since = created
        if decided or len(rows) < limit:
            break
    return ((now or utcnow()) - since).total_seconds()


def _generation_bound_s(db: Session, worker: Worker, prompts: int) -> float:
    """IDLE_PATIENCE times `prompts` groups at the seconds the worker's latest delivered groups took (what it
    reported, but never more than their lease had been held when they came: a worker's say alone buys no idle
    time, nor does a group refused or too late to be worth anything), or at its claimed rate before it delivered."""
    rows = db.execute(
        select(Rollout.gen_seconds, Rollout.created_at, Lease.created_at).join(Lease, Lease.id == Rollout.lease_id)
        .where(Rollout.worker_id == worker.id, DELIVERED)
        .order_by(Rollout.created_at.desc()).limit(IDLE_CHAIN)).all()
    taken = [min(gen, (came - granted).total_seconds()) for gen, came, granted in rows]
    per_group = sum(taken) / len(taken) if taken else 1.0 / (worker.rollouts_per_s or 1.0)  # as the scheduler
    return IDLE_PATIENCE * prompts * per_group


def unjudged(db: Session, worker: Worker) -> int:
    """The worker's groups that wait for the learner's verdict, on every job."""
    return db.scalar(select(func.count()).where(
        Rollout.worker_id == worker.id, Rollout.status.in_((RolloutStatus.accepted, RolloutStatus.claimed)),
        Rollout.audit.is_(None))) or 0


def held_back(db: Session, worker: Worker) -> bool:
    """Whether the worker may lease nothing until the learner judges its groups (on probation or suspect)."""
    return worker.trust in (TrustState.probation, TrustState.suspect) and unjudged(db, worker) >= UNJUDGED


def _unjudged_room(db: Session, worker: Worker) -> int:
    """How many more prompts a worker whose every group is audited (probation, suspect) may take: at most
    UNJUDGED of its groups wait for the learner's verdict at once, counting the prompts it holds, so a worker that
    cheats from its first group is quarantined within two such batches, whatever the lease room. None for a
    trusted worker (its audits are the windows of trust.should_audit)."""
    if worker.trust not in (TrustState.probation, TrustState.suspect):
        return UNJUDGED_ANY
    waiting, held = unjudged(db, worker), holding(db, worker)
    room = UNJUDGED - waiting - held
    if room <= 0:
        raise ApiError(409, _no_unjudged_room(db, worker, waiting, held), headers=_retry_after(1.0))
    return room


def holding(db: Session, worker: Worker) -> int:
    """The prompts the worker's active leases hold and it has not submitted."""
    return db.scalar(select(func.count()).select_from(Prompt).join(Lease, Lease.id == Prompt.lease_id)
                     .where(Lease.worker_id == worker.id, Lease.status == LeaseStatus.active,
                            Prompt.state == PromptState.leased)) or 0


def _no_unjudged_room(db: Session, worker: Worker, waiting: int, held: int) -> str:
    """What fills a probation worker's room, both parts named: a worker restarted while holding a lease was told
    only of groups waiting for their audit ("0 of this worker's groups wait..."), when its old lease's prompts
    were what counted."""
    parts = [f"{waiting} of this worker's groups wait for the learner's audit"] if waiting else []
    if held:
        leases = db.scalars(select(Lease.id).where(Lease.worker_id == worker.id, Lease.status == LeaseStatus.active))
        parts.append(f"its active leases ({', '.join(leases)}) hold {held} prompts it has not submitted (a worker "
                     "restarted while holding them: submit them, or release the lease, POST "
                     "/v1/leases/LEASE_ID/release; they return to the pool when it expires)")
    return (f"on {worker.trust.value}: at most {UNJUDGED} of this worker's prompts are out at once until it is "
            f"trusted, and {' and '.join(parts)}; retry once they are judged or returned")


def lease_room(db: Session, job: Job, spec: JobSpec, version: int) -> int:
    """How many more groups of `version` the learner can still train before that version goes stale:
    the steps left until then (t .. x + S) times R, less what this step and the next have claimed and
    what is queued or leased already with a version still admissible (all of which the learner takes
    first: it claims oldest first). Leasing beyond this only makes groups that arrive too late — the
    staleness contract. A Tinker fleet job's prompts each ask for one version (api/tinker/fleet.py): no
    staleness to run out, so the pool alone bounds a lease."""
    if not job.kind.has_task:
        return 256
    steps_left = version + spec.staleness - job.step + 1
    oldest = spec.oldest_admissible(job.step)  # what is already too stale will be rejected, not trained
    # A prompt is still leased while its lease is active and it has no group in that lease (an accepted group's
    # prompt is submitted, a rejected one's went back to the pool): counted per lease, not per prompt, as the
    # leases' prompts less their groups, so the count that holds the job's lock grows with the leases in
    # flight, not with the prompts they hold (16 a lease in the benches).
    admissible = (Lease.job_id == job.id, Lease.status == LeaseStatus.active, Lease.version >= oldest)
    taken = db.execute(select(
        select(func.count()).where(Rollout.job_id == job.id, Rollout.status == RolloutStatus.accepted,
                                   Rollout.version >= oldest).scalar_subquery(),
        select(func.count()).where(Rollout.job_id == job.id, Rollout.status == RolloutStatus.claimed,
                                   Rollout.claim_step >= job.step).scalar_subquery(),
        select(func.coalesce(func.sum(func.json_array_length(Lease.prompt_ids)), 0)).where(*admissible)
        .scalar_subquery(),
        select(-func.count()).select_from(Rollout).join(Lease, Lease.id == Rollout.lease_id).where(*admissible)
        .scalar_subquery(),
    )).one()
    return steps_left * spec.grpo.prompts_per_step - sum(taken)


def _step_period_s(db: Session, job: Job) -> float:
    """Recent seconds between the learner's step commits: when room is likely to free up."""
    times = list(db.scalars(select(StepMetric.created_at).where(StepMetric.job_id == job.id)
                            .order_by(StepMetric.step.desc()).limit(6)))
    if len(times) < 2:
        return 1.0
    return (times[0] - times[-1]).total_seconds() / (len(times) - 1)


def _retry_after(seconds: float) -> dict[str, str]:
    seconds = min(max(seconds, 0.1), 30.0)
    return {"Retry-After": str(math.ceil(seconds)), "Retry-After-Ms": str(round(seconds * 1000))}


def _check_version(db: Session, job: Job, worker: Worker, version: int, spec: JobSpec) -> None:
    # The learner's auditor has no weights for a number that is not a version; a version without probes is held
    # when claimed, one with them once proven.
    probed = possession.probed(db, job.id, version) if job.version is not None and version <= job.version else None
    if probed is None:
        raise ApiError(409, f"version {version} is not published; the latest is {job.version} (this job publishes "
                            f"every {spec.publish_period} steps)", field="version")
    if version < spec.oldest_admissible(job.step):
        raise ApiError(
            409, f"version {version} is too stale for step {job.step} (S={spec.staleness}): "
            f"fetch version {job.version} first", field="version")
    if version not in (worker.versions_held or []):
        raise ApiError(409, f"this worker has not reported holding version {version}: send a heartbeat with it "
                       "in versions_held first", field="version")
    if probed and not possession.proven(db, job.id, version, worker.id):
        raise ApiError(409, f"this worker has not proven it holds version {version}: answer the challenge of the "
                       "last heartbeat reply (assignment.challenges) in the `proofs` of a heartbeat, with the "
                       "sha256 of those bytes of your copy, then lease again", field="version")


def _take_available(db: Session, job: Job, limit: int, version: int) -> list[Prompt]:
    # Pure function of the job's state: lowest (epoch, seeded order key) first. On PostgreSQL,
    # SKIP LOCKED lets concurrent claimers take disjoint rows; on SQLite the transaction holds the lock.
    # A prompt that asks for a version (a Tinker request) goes only to a lease of that version.
    query = (
        select(Prompt)
        .where(Prompt.job_id == job.id, Prompt.state == PromptState.available,
               Prompt.version.is_(None) | (Prompt.version == version))
        .order_by(Prompt.epoch, Prompt.order_key)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    return list(db.scalars(query))


def _start_next_epoch(db: Session, job: Job, seed: int) -> bool:
    """When no training prompt is left to lease, the trained ones start over in a new seeded order (held-out
    and set-aside prompts stay out). Not once every prompt is trained: an epoch's last few, submitted and waiting
    for a step that needs more groups than they are (an epoch that is not a whole number of steps), waited for
    the next epoch, which waited for them, and the job stalled for good. A prompt still in flight finishes its
    epoch and joins the next start after it."""
    prompts = list(db.scalars(select(Prompt).where(Prompt.job_id == job.id, Prompt.state == PromptState.trained)
                              .with_for_update()))
    for p in prompts:
        p.epoch += 1
        p.state = "available"
        p.order_key = order_key(seed, job.id, p.index, p.epoch)
    return bool(prompts)


def leased_prompts(db: Session, lease: Lease, job: Job, prompts: list[Prompt] | None = None
                   ) -> list[dict[str, object]]:
    """The lease's prompts as a worker gets them, lowest (epoch, order key) first; `prompts`: those rows, when the
    caller has them in that order already (a lease just created)."""
    spec = spec_of(job)
    if prompts is None:
        prompts = list(db.scalars(select(Prompt).where(Prompt.id.in_(lease.prompt_ids))
                                  .order_by(Prompt.epoch, Prompt.order_key)))
    return [
        {"prompt_id": p.id, "text": p.text, "context": p.context,
         "seed": prompt_seed(spec.seed, job.id, p.index, p.epoch),
         **({"token_ids": p.token_ids, "sampling": p.sampling} if p.request_id else {})}
        for p in prompts
    ]
