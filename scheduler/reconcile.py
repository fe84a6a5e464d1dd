"""One reconcile tick: the control loop that keeps the database's desired state true.

In order: workers that stopped heartbeating go offline (their leases return); expired leases return
their prompts; quarantines that ran out end; the cost
ledger advances (billing.py); jobs over budget, or whose owner spent their daily quota, pause;
finished-but-orphaned jobs are closed; learners are launched or relaunched when missing or dead, into
the learner hosts' free slots, the rest wait in line (hosts.py, queue.py); then the activation solver picks which
workers serve which job and the choice is applied and recorded; once that is committed, reported relays are
probed (relay_probe.py: their fetches hold no transaction open). Every step is idempotent, so a tick
delivered twice (at-least-once Celery) or interrupted half-way does no harm. One job's trouble (a spec that
no longer validates, a planner failure) is logged with the job, recorded in its `status_reason` and rolled
back, and the tick goes on for the others (`Trouble`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from echo2.protocol import JobKind, JobStatus, PauseCause, TrustState, WorkerStatus
from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from api.db import WRITER_LOCK
from api.models import (
    Decision,
    Job,
    Lease,
    Rollout,
    SchedulerState,
    StepMetric,
    VersionHold,
    WeightVersion,
    Worker,
    utcnow,
)
from api.services import fleet, pool
from api.services.estimate import busy_seconds
from api.services.jobs import finish_job, over_budget, pause_job, spec_of, valid_spec
from api.services.learning import issue_learner_token
from api.services.pool import UNDELIVERED, expire_leases
from api.services.trust import release_quarantines
from api.settings import Settings
from api.tinker import fleet as tinker_fleet
from planner.capacity import (
    DEFAULT_T_TRAIN_S,
    JobProfile,
    WorkerPerf,
    WorkerProfile,
    hard_constraint_violation,
    required_throughput,
)
from planner.decision import Action, SolverConfig, SolverState, WorkerDecision
from planner.decision import Decision as PlanDecision
from planner.solver import decide

from . import billing, hosts, queue, relay_probe
from .placement import Line, Placement

log = logging.getLogger(__name__)
Launcher = Callable[[str, str, Placement], None]  # (job id, learner token, where) -> enqueue its learner
MU_WINDOW_S = 60.0
BCAST_SAMPLES = 5  # versions averaged for a worker's dissemination time
TRIAL_RETRY = 10  # grace periods before a worker whose trial delivered nothing is tried again
WORKING = TrustState.working()  # quarantined and banned workers are never activated
LIVE = JobStatus.live()
UNPAUSED = (JobStatus.queued, JobStatus.running)


@dataclass
class Launch:
    job_id: str
    token: str
    placement: Placement


@dataclass
class TickReport:
    offline: int = 0
    prompts_returned: int = 0
    launched: list[Launch] | None = field(default=None, repr=False)
    activated: int = 0
    deactivated: int = 0

    def __str__(self) -> str:
        """What the scheduler logs: the jobs launched, never their learner tokens."""
        jobs = [launch.job_id for launch in self.launched or []]
        return (f"offline={self.offline} prompts_returned={self.prompts_returned} launched={jobs} "
                f"activated={self.activated} deactivated={self.deactivated}")


def tick(db: Session, settings: Settings, launch: Launcher, now: datetime | None = None) -> TickReport:
    now = now or utcnow()
    # Read under its row lock, held to the tick's commit: ticks take turns even where the Redis lock that keeps
    # them apart ran out (a tick longer than its 120 s), so no two bill the same interval.
    last = db.get(SchedulerState, "last_tick", with_for_update=True)
    report = TickReport(launched=[])
    report.offline = _mark_offline(db, settings, now)
    report.prompts_returned = expire_leases(db, now)
    tinker_fleet.sweep(db)
    release_quarantines(db, now)
    billing.bill(db, settings, now, last.value.get("at") if last is not None else None)
    _put_state(db, "last_tick", {"at": now.timestamp()})
    jobs = list(db.scalars(select(Job).where(Job.status.in_(LIVE)).with_for_update(**WRITER_LOCK)))
    trouble = Trouble(db)
    for job in jobs:
        trouble.isolate(job, "check its budget and finish", lambda job=job: _check_job(db, job, settings, now))
    queue.apply_daily_quotas(db, jobs, now)
    # A Tinker fleet job has no learner of its own: the Tinker learner host publishes its versions.
    report.launched = _launch(db, settings, [j for j in jobs if j.status in UNPAUSED and j.kind.has_learner], now)
    db.flush()
    report.activated, report.deactivated = _activate(db, settings, now, trouble)
    trouble.settle()
    db.commit()
    for one in report.launched:  # enqueue only after the launch is recorded
        launch(one.job_id, one.token, one.placement)
    relay_probe.probe_reported(db, settings, now)  # after the commit: its fetches hold no lock
    return report


def _mark_offline(db: Session, settings: Settings, now: datetime) -> int:
    cutoff = now - timedelta(seconds=settings.worker_offline_after_s)
    silent = db.scalars(select(Worker).where(
        Worker.status.in_((WorkerStatus.idle, WorkerStatus.active, WorkerStatus.draining)),
        func.coalesce(Worker.last_heartbeat_at, Worker.created_at) < cutoff))
    count = 0
    for worker in silent:
        fleet.unassign(db, worker)
        worker.status = WorkerStatus.offline
        count += 1
    return count


def _check_job(db: Session, job: Job, settings: Settings, now: datetime) -> None:
    if job.status in UNPAUSED and (why := over_budget(job)) is not None:
        pause_job(db, job, PauseCause.budget, why)
    _close_orphan(db, job, settings, now)


class Trouble:
    """One job's trouble never stops a tick for the others: its part of the tick runs in a savepoint, and a
    failure is logged with the job, rolled back, and recorded on it (`status_reason`) while the tick goes on.
    The reason is cleared at the first tick that plans the job again (the failures of the last tick are kept
    in the scheduler state to know which reasons are the scheduler's own)."""

    def __init__(self, db: Session) -> None:
        self.db, self.before = db, _state(db, "trouble")
        self.failed: dict[str, str] = {}

    def isolate(self, job: Job, what: str, step: Callable[[], object]) -> bool:
        """Run one job's step; False (and recorded) when it failed."""
        try:
            with self.db.begin_nested():
                step()
            return True
        except Exception as exc:
            self.record(job, what, exc)
            return False

    def record(self, job: Job, what: str, exc: Exception) -> None:
        log.error("job %s: could not %s", job.id, what, exc_info=exc)
        reason = (f"the scheduler could not {what} this job: {type(exc).__name__}: {exc} (retried every tick; "
                  "other jobs are not held up)")[:512]
        self.failed[job.id] = reason
        if not job.status.is_terminal():
            job.status_reason = reason

    def settle(self) -> None:
        """Clear the reasons of jobs that came through this tick; keep this tick's for the next."""
        for job_id, reason in self.before.items():
            job = self.db.get(Job, job_id)
            if job_id not in self.failed and job is not None and job.status_reason == reason:
                job.status_reason = None
        _put_state(self.db, "trouble", self.failed)


def _launch(db: Session, settings: Settings, jobs: list[Job], now: datetime) -> list[Launch]:
    """Learners for the jobs that need one, into free learner slots (scheduler/queue.py, placement.py)."""
    alive = [j for j in jobs if j.learner_launched_at is not None and not _learner_needed(j, settings, now)]
    line = Line.of(hosts.live_hosts(db, now, settings.learner_dead_after_s))
    for job in alive:
        line.hold(job)
    launched: list[Launch] = []

    def launch(job: Job, placement: Placement) -> bool:
        if _crash_loop(db, job, settings):
            return False
        job.learner_launched_at, job.learner_launches = now, job.learner_launches + 1
        job.learner_placement = placement.as_dict()
        launched.append(Launch(job.id, issue_learner_token(db, job), placement))
        return True

    queue.admit(db, [j for j in jobs if j not in alive and j.status in UNPAUSED], line, launch)
    return launched


def _close_orphan(db: Session, job: Job, settings: Settings, now: datetime) -> None:
    """A learner that died after its last step leaves a finished job running: close it."""
    if job.status != JobStatus.running or job.step < spec_of(job).max_steps or job.version is None:
        return
    last = job.learner_heartbeat_at or job.learner_launched_at or now
    if now - last > timedelta(seconds=settings.learner_dead_after_s):
        finish_job(db, job, JobStatus.succeeded, f"finished {job.step} steps (closed by the scheduler)")
        job.final_version = job.version


def _crash_loop(db: Session, job: Job, settings: Settings) -> bool:
    """Count a relaunch that follows no committed step; after `learner_max_failures` of them in a row the
    job fails with the learner's last error instead of being relaunched forever. True if it failed."""
    if job.learner_launched_at is None:
        return False
    if job.learner_failure_step == job.step:
        job.learner_failures += 1
    else:
        job.learner_failures, job.learner_failure_step = 1, job.step
    if job.learner_failures < settings.learner_max_failures:
        return False
    error = job.learner_error or "it stopped heartbeating without reporting an error"
    finish_job(db, job, JobStatus.failed,
               f"the learner failed {job.learner_failures} times in a row at step {job.step}: {error}"[:512])
    return True


def _learner_needed(job: Job, settings: Settings, now: datetime) -> bool:
    launched = job.learner_launched_at
    if launched is None:
        return True
    if job.learner_crashed_at is not None and job.learner_crashed_at >= launched:
        return True  # it reported its own death: no need to wait for silence
    beat = job.learner_heartbeat_at
    if beat is not None and beat >= launched:  # it started: relaunch once it falls silent
        return now - beat > timedelta(seconds=settings.learner_dead_after_s)
    # launched but not started yet (loading a model): the host may have lost it
    return now - launched > timedelta(seconds=settings.learner_start_timeout_s)


def _activate(db: Session, settings: Settings, now: datetime, trouble: Trouble) -> tuple[int, int]:
    jobs = [j for j in db.scalars(select(Job).where(Job.status == JobStatus.running, Job.version.is_not(None)))
            if j.id not in trouble.failed]
    workers = list(db.scalars(select(Worker).where(Worker.status.in_((WorkerStatus.idle, WorkerStatus.active)),
                                                   Worker.trust.in_(WORKING))))
    job_profiles = {}
    for job in jobs:
        trouble.isolate(job, "measure its need for workers",
                        lambda job=job: job_profiles.setdefault(job.id, _job_profile(db, job)))
    jobs = [j for j in jobs if j.id in job_profiles]
    profiles = {w.id: _worker_profile(db, w, now, list(job_profiles.values()), settings) for w in workers}
    _share_trials(db, workers, profiles, job_profiles, now, settings)
    stored = _state(db, "solver")
    config = SolverConfig(method=settings.solver, min_dwell_s=settings.min_dwell_s)
    decision = _decide(jobs, job_profiles, list(profiles.values()), now.timestamp(),
                       SolverState.from_dict(stored) if stored else None, config, trouble)
    if decision is None:
        return 0, 0
    _put_state(db, "solver", decision.state.to_dict())
    by_id, jobs_by_id = {w.id: w for w in workers}, {j.id: j for j in jobs}
    runs = _runs(db, list(jobs_by_id))
    activated = deactivated = 0
    for line in decision.workers:
        worker = by_id.get(line.worker_id)
        if worker is None:
            continue
        job_id = line.job_id or worker.job_id  # before unassigning: a deactivation is explained on its job
        if line.action is Action.ACTIVATE and line.job_id in jobs_by_id:
            fleet.assign(db, worker, jobs_by_id[line.job_id], settings)
            worker.activated_mu = profiles[worker.id].perf_for(line.job_id).mu  # what its pay is measured against
            activated += 1
        elif line.action is Action.DEACTIVATE or (line.job_id is None and worker.job_id is not None):
            fleet.unassign(db, worker)
            deactivated += 1
        if line.action in (Action.ACTIVATE, Action.DEACTIVATE) or decision.resolved:
            inputs = {"method": decision.method, "jobs": [_alloc(a) for a in decision.jobs]}
            _record(db, runs, worker.id, job_id, line, (decision.trigger, inputs, now), decision.resolved)
    _say_who_serves(jobs, {j.id for j in jobs if required_throughput(job_profiles[j.id]) > 0}, workers)
    return activated, deactivated


WAITING = "waiting for workers"  # a running job's status_reason while none serves it


def _say_who_serves(jobs: list[Job], needing: set[str], workers: list[Worker]) -> None:
    """A running job that needs groups and that no worker serves says so, and why in a word; the decisions
    (`echo2 jobs explain`) say the rest. It ran with no reason at all, its learner idle and billed. Another
    reason (its learner starting) stays; this one goes once a worker serves the job."""
    served = {w.job_id for w in workers}
    for job in jobs:
        waiting = job.id in needing and job.id not in served
        ours = (job.status_reason or "").startswith(WAITING)
        if not waiting and ours:
            job.status_reason = None
        elif waiting and (ours or job.status_reason is None):
            fleet_now = {0: "no worker is online", 1: "the one worker online does not serve it now"}.get(
                len(workers), f"none of the {len(workers)} workers online serves it now")
            billed = "; its learner waits for their groups, and is billed meanwhile" if job.kind.has_learner else ""
            job.status_reason = f"{WAITING}: {fleet_now} (echo2 jobs explain {job.id} says why){billed}"


def _decide(jobs: list[Job], job_profiles: dict[str, JobProfile], workers: list[WorkerProfile], now: float,
            state: SolverState | None, config: SolverConfig, trouble: Trouble) -> PlanDecision | None:
    """The activation decision over every job; when it fails, each job is solved alone to find the ones that
    fail, which are recorded and left out, and the others are decided together. None (nothing changes this
    tick) only if they still fail together."""
    try:
        return decide(list(job_profiles.values()), workers, now=now, state=state, config=config)
    except Exception as exc:
        joint = exc
    for job in jobs:
        try:
            decide([job_profiles[job.id]], workers, now=now, state=state, config=config)
        except Exception as exc:
            trouble.record(job, "plan its workers", exc)
            del job_profiles[job.id]
    try:
        return decide(list(job_profiles.values()), workers, now=now, state=state, config=config)
    except Exception:
        for job in jobs:
            if job.id in job_profiles:
                trouble.record(job, "plan workers for the jobs together", joint)
        return None


def _record(db: Session, runs: dict[tuple[str | None, str], Decision], worker_id: str, job_id: str | None,
            line: WorkerDecision, why: tuple[str, dict, datetime], resolved: bool) -> None:
    """The line on the job it concerns; on a re-solve, also a line on every other running job saying why
    the worker is not on it (a worker serving no job has no line of its own unless no job runs). Stored as
    changes: the same action as the worker's newest row on that job adds to that row's run (its count, time
    and newest wording) instead of a row per re-solve."""
    trigger, inputs, now = why
    rows = [(job_id, line.action, line.line())] if job_id is not None or not line.others else []
    if resolved:
        rows += [(other, action, f"{action} {worker_id}: {reason}") for other, action, reason in line.others
                 if other != job_id]
    for job, action, text in rows:
        run = runs.get((job, worker_id))
        if run is not None and run.action == action:
            run.repeats += 1
            run.line, run.trigger, run.inputs, run.decided_at = text[:512], trigger[:256], inputs, now
            continue
        runs[(job, worker_id)] = row = Decision(job_id=job, worker_id=worker_id, action=action, line=text[:512],
                                                trigger=trigger[:256], inputs=inputs, created_at=now, decided_at=now)
        db.add(row)


def _runs(db: Session, job_ids: list[str]) -> dict[tuple[str | None, str], Decision]:
    """Each worker's newest decision row on each of these jobs (and on none)."""
    newest = (select(func.max(Decision.id)).where(or_(Decision.job_id.in_(job_ids), Decision.job_id.is_(None)))
              .group_by(Decision.job_id, Decision.worker_id))
    return {(d.job_id, d.worker_id): d for d in db.scalars(select(Decision).where(Decision.id.in_(newest)))}


def _alloc(a) -> dict:  # type: ignore[no-untyped-def]
    return {"job_id": a.job_id, "throughput": a.throughput, "required": a.required, "feasible": a.feasible,
            "reason": a.reason, "price_per_h": a.price_per_h, "predicted_utilisation": a.predicted_utilisation}


def _job_profile(db: Session, job: Job) -> JobProfile:
    spec = spec_of(job)
    recent = list(db.scalars(select(StepMetric.t_train_s).where(StepMetric.job_id == job.id)
                             .order_by(StepMetric.step.desc()).limit(5)))
    t_train = sum(recent) / len(recent) if recent else DEFAULT_T_TRAIN_S
    rollouts = spec.grpo.prompts_per_step
    if job.kind is JobKind.tinker_fleet:  # a sampler's need: the groups asked for over the last minute
        rollouts, t_train = tinker_fleet.demand(db, job), tinker_fleet.DEMAND_WINDOW_S
    return JobProfile(job_id=job.id, rollouts_per_step=rollouts, t_train_s=max(t_train, 1e-3),
                      staleness=spec.staleness, publish_period=spec.publish_period, priority=spec.priority,
                      submitted_at=job.created_at.timestamp(), vram_need_gb=job.memory_need_gb or 0.0,
                      backends=frozenset(b.value for b in spec.workers.backends),
                      max_usd_per_group=spec.workers.max_usd_per_group)


def _worker_profile(db: Session, worker: Worker, now: datetime, jobs: list[JobProfile],
                    settings: Settings) -> WorkerProfile:
    """μ from the groups it delivered that were worth something (accepted, and not rejected for its own
    fault or for arriving late) in the last minute of work, or over its whole activation when that minute holds none (a
    slow worker, or one that waited for room in the queue): the raw generation rate. A worker that has
    delivered nothing since it was activated is on trial: it counts, whatever it claims, for at most
    `trial_share` of each job's need. A trial that delivered nothing for `delivery_grace_s` fails: the
    worker is measured at zero (and so not activated) until `TRIAL_RETRY` grace periods later; not one that was
    refused every lease meanwhile because its groups wait for the learner's audit (pool.held_back), nor one its
    job has no lease room for (the learner is behind: _no_room), nor one still generating the prompts it holds at
    its pace (pool.generating). So does a worker, measured or not, that held
    prompts without sending a group for longer than it may (routes/leases.py, pool.idle_past_bound: the lease room
    it kept from every other worker)."""
    active_s = (now - worker.active_since).total_seconds() if worker.active_since else 0.0
    window = min(active_s, MU_WINDOW_S)
    done, gen = _delivered(db, worker.id, now - timedelta(seconds=MU_WINDOW_S))
    if not done and worker.active_since is not None:
        # A SmolLM2 worker on CPU, with a minute between two deliveries, was failed as if it never worked.
        (done, gen), window = _delivered(db, worker.id, worker.active_since), active_s
    if not done and active_s >= settings.delivery_grace_s and not pool.held_back(db, worker) \
            and not _no_room(db, worker) and not pool.generating(db, worker, now, settings):
        worker.trial_failed_at = now
    retry_at = worker.trial_failed_at + timedelta(seconds=TRIAL_RETRY * settings.delivery_grace_s) \
        if worker.trial_failed_at else now
    trial = None
    if now < retry_at:  # a trial failed here, or prompts held idle (routes/leases.py)
        mu = 0.0
    elif done and active_s >= 5:
        mu = done / window
    else:
        mu, trial = worker.rollouts_per_s or 1.0, worker.rollouts_per_s or 1.0
    t_gen = gen if gen else 1.0 / max(mu, 1e-9)
    t_bcast = _t_bcast(db, worker)
    per_job = {j.job_id: WorkerPerf(min(trial, settings.trial_share * required_throughput(j)), t_gen, t_bcast)
               for j in jobs} if trial is not None else {}
    return WorkerProfile(worker_id=worker.id, price_per_h=worker.price_per_hour, vram_gb=worker.vram_gb,
                         backends=frozenset(worker.backends), mu=mu, t_gen_s=t_gen, t_bcast_s=t_bcast,
                         perf_by_job=per_job)


def _share_trials(db: Session, workers: list[Worker], profiles: dict[str, WorkerProfile],
                  job_profiles: dict[str, JobProfile], now: datetime, settings: Settings) -> None:
    """On a job a measured worker delivers for, the workers on trial of an unproven provider (none of its workers
    has delivered a group, or one failed its trial lately) count together for at most `trial_share` of its need,
    each for its share of that: else four fresh $0/h workers claiming any rate covered a job's whole need on claims
    alone and pushed its delivering worker off it (its groups in flight lost), then four more once they failed. A
    job no worker has delivered for yet is staffed on claims, a quarter of its need per worker, as before."""
    on_trial: dict[str, list[str]] = {}
    for w in workers:
        if profiles[w.id].perf_by_job:
            on_trial.setdefault(w.provider_id, []).append(w.id)
    served = {w.job_id for w in workers if w.job_id in job_profiles and not profiles[w.id].perf_by_job
              and profiles[w.id].mu > 0}
    if not on_trial or not served:
        return
    for provider_id in _unproven(db, list(on_trial), now, settings):
        ids = on_trial[provider_id]
        for job_id in served:
            job = job_profiles[job_id]
            able = [i for i in ids if hard_constraint_violation(profiles[i], job) is None]  # others count nothing
            cap, claimed = settings.trial_share * required_throughput(job), sum(
                profiles[i].perf_by_job[job_id].mu for i in able)
            for i in able if claimed > cap else ():
                perf = profiles[i].perf_by_job[job_id]
                profiles[i].perf_by_job[job_id] = replace(perf, mu=perf.mu * cap / claimed)


def _unproven(db: Session, provider_ids: list[str], now: datetime, settings: Settings) -> list[str]:
    """Providers none of whose workers (deleted ones too) has delivered an accepted group, or one of whose workers
    failed its trial within the last TRIAL_RETRY grace periods."""
    lately = now - timedelta(seconds=TRIAL_RETRY * settings.delivery_grace_s)
    proven = set(db.scalars(select(Worker.provider_id).where(Worker.provider_id.in_(provider_ids))
                            .group_by(Worker.provider_id)
                            .having(func.max(Worker.accepted_rollouts) > 0,
                                    func.coalesce(func.max(Worker.trial_failed_at), lately) <= lately)))
    return [p for p in provider_ids if p not in proven]


def _no_room(db: Session, worker: Worker) -> bool:
    """Whether the worker's job refuses it every lease now for lack of room (what others queued and leased covers
    what the learner can train before the newest version goes stale): the platform's delay, not the worker's
    failure. What the worker holds itself does not count: a worker that leases and never submits fills the room
    with its own leases."""
    job = db.get(Job, worker.job_id) if worker.job_id else None
    spec = valid_spec(job) if job is not None else None
    if job is None or spec is None or job.status != JobStatus.running or job.version is None or not job.kind.has_task:
        return False
    return pool.lease_room(db, job, spec, job.version) + pool.holding(db, worker) <= 0


def _delivered(db: Session, worker_id: str, since: datetime) -> tuple[int, float | None]:
    """Groups the worker delivered since then that were worth something, and the seconds it took to make one:
    their mean reported generation time, or what the control plane's clock saw where that is longer. T_gen
    decides whether a worker is fresh enough to activate (planner/capacity.py): a worker that says it is faster
    than it is would be activated where its groups arrive stale.
    The clock's figure: the time the worker held the leases it sent groups of since then, each from its grant
    to its last group (overlapping leases counted once: it books its next lease while it generates), over all
    their groups. Whole leases, so a long one answered a group at a time is not its whole life over its last few."""
    answered = select(Rollout.lease_id).where(Rollout.worker_id == worker_id, Rollout.created_at >= since)
    worth = (Rollout.created_at >= since) & (Rollout.reject_kind.not_in(UNDELIVERED) | Rollout.reject_kind.is_(None))
    leases = db.execute(select(Lease.created_at, func.max(Rollout.created_at), func.count(),
                               func.count().filter(worth), func.sum(Rollout.gen_seconds).filter(worth))
                        .join(Rollout, Rollout.lease_id == Lease.id)
                        .where(Lease.worker_id == worker_id, Lease.id.in_(answered))
                        .group_by(Lease.id, Lease.created_at)).all()
    done = sum(n for _, _, _, n, _ in leases)
    made = sum(n for _, _, n, _, _ in leases)
    claimed = sum(float(g or 0.0) for *_, g in leases) / done if done else 0.0
    measured = busy_seconds([(start, end) for start, end, *_ in leases]) / made if made else 0.0
    return done, max(claimed, measured) or None


def _t_bcast(db: Session, worker: Worker) -> float:
    """Seconds from a version's announcement until this worker held it (proved it, for a version with
    probes), as the control plane saw it (mean of its last few versions); the worker's own download time
    until then."""
    seen = db.execute(select(VersionHold.held_at, WeightVersion.created_at)
                      .join(WeightVersion, and_(WeightVersion.job_id == VersionHold.job_id,
                                                WeightVersion.version == VersionHold.version))
                      .where(VersionHold.worker_id == worker.id)
                      .order_by(VersionHold.held_at.desc()).limit(BCAST_SAMPLES)).all()
    if seen:
        return sum(max(0.0, (held - announced).total_seconds()) for held, announced in seen) / len(seen)
    return float((worker.stats or {}).get("last_download_s") or 0.0)


def _state(db: Session, key: str) -> dict:
    row = db.get(SchedulerState, key)
    return dict(row.value) if row is not None else {}


def _put_state(db: Session, key: str, value: dict) -> None:
    row = db.get(SchedulerState, key)
    if row is None:
        db.add(SchedulerState(key=key, value=value))
    else:
        row.value = value
