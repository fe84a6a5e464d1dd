"""The learner's side: start/resume, commit a trained step with its metrics."""

from __future__ import annotations

from itertools import takewhile

from echo2.protocol import (
    AuditReport,
    AuditVerdict,
    AuditVerdicts,
    JobSpec,
    JobStatus,
    LearnerHeartbeat,
    PauseCause,
    PromptState,
    RejectKind,
    RolloutStatus,
    StepAck,
    StepReport,
)
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from .. import auth
from ..errors import ApiError
from ..models import Job, Prompt, Rollout, StepMetric, Worker, utcnow
from ..settings import Settings
from . import evidence, trust
from .admission import release_claims
from .jobs import over_budget, pause_job, spec_of
from .pool import return_prompts


def start(db: Session, job: Job) -> int:
    """Mark the job running (first start) or resumed; claims of a dead learner are released."""
    if job.status.is_terminal():
        raise ApiError(409, f"job {job.id} is {job.status}; it cannot be (re)started")
    if job.status == JobStatus.paused:
        raise ApiError(409, f"job {job.id} is paused ({job.status_reason}); it resumes with a new learner")
    if job.status == JobStatus.queued:
        job.status, job.started_at = JobStatus.running, job.started_at or utcnow()
        job.status_reason = job.queue_position = None
    job.learner_heartbeat_at = utcnow()
    return release_claims(db, job.id)


def commit_step(db: Session, job: Job, report: StepReport, settings: Settings) -> StepAck:
    if report.step < job.step and db.get(StepMetric, (job.id, report.step)) is not None:
        return _ack(job)  # a retried report of a committed step
    if job.status not in (JobStatus.running, JobStatus.paused):  # a step trained as it paused counts
        raise ApiError(409, f"job {job.id} is {job.status}; steps can only be reported while running")
    if report.step != job.step:
        raise ApiError(409, f"expected a report for step {job.step}, got {report.step}", field="step")
    _check_disjoint(report)
    rollouts = _claimed(db, job, report, report.rollout_ids, "rollout_ids")
    refused = _claimed(db, job, report, [r.rollout_id for r in report.rejected], "rejected")
    unscored = _claimed(db, job, report, [r.rollout_id for r in report.unscored], "unscored")
    _judge(db, job, report, {r.id: r for r in rollouts + refused + unscored}, settings)
    _mark_unscored(db, report, {r.id: r for r in unscored})
    _mark_trained(db, job, report, rollouts)
    evidence.compare_fleet(db, job.id, report.step)
    db.add(_metric_row(db, job, report, len(rollouts)))
    job.step += 1
    job.reward_mean = report.reward_mean if report.reward_mean is not None else job.reward_mean
    spec = spec_of(job)
    job.reward_failures = job.reward_failures + len(unscored) if unscored else 0
    if job.status == JobStatus.running and job.step < spec.max_steps:
        if job.reward_failures >= spec.reward_failures_to_pause:
            pause_job(db, job, PauseCause.reward, _unscored_reason(db, job, spec, report.unscored[-1].reason))
        elif (why := over_budget(job)) is not None:
            pause_job(db, job, PauseCause.budget, why)  # the ack tells the learner to stop; it resumes when raised
    return _ack(job)


def _mark_unscored(db: Session, report: StepReport, rows: dict[str, Rollout]) -> None:
    """Groups the task could not score: rejected as the platform's fault (no strike; the sender is paid), their
    prompts back in the pool to be tried again."""
    for item in report.unscored:
        rollout = rows[item.rollout_id]
        rollout.status, rollout.reject_kind, rollout.claim_step = RolloutStatus.rejected, RejectKind.reward_failed, None
        rollout.reason = f"the task could not score it: {item.reason}"[:256]
    return_prompts(db, [rows[r.rollout_id].prompt_id for r in report.unscored], from_state="submitted")


def _unscored_reason(db: Session, job: Job, spec: JobSpec, last: str) -> str:
    return (f"paused at step {job.step}: {job.reward_failures} groups in a row could not be scored by task "
            f"{spec.task.name} (last: {last}); none of them was trained{_empty_steps(db, job, spec)}. Fix it, then "
            f"resume the job: echo2 jobs resume {job.id} (POST /v1/jobs/{job.id}/resume)")


def _empty_steps(db: Session, job: Job, spec: JobSpec) -> str:
    """The steps just before the pause that trained no group, said: they count toward max_steps all the same."""
    trained = db.scalars(select(StepMetric.groups).where(StepMetric.job_id == job.id)
                         .order_by(StepMetric.step.desc()).limit(spec.reward_failures_to_pause)).all()
    empty = len(list(takewhile(lambda groups: groups == 0, trained)))
    if not empty:
        return ""
    steps = f"step {job.step - 1}" if empty == 1 else f"steps {job.step - empty}-{job.step - 1}"
    return f", and {steps} trained no group but count{'s' if empty == 1 else ''} among its {spec.max_steps} steps"


def _check_disjoint(report: StepReport) -> None:
    trained, refused = set(report.rollout_ids), {r.rollout_id for r in report.rejected}
    unscored = {r.rollout_id for r in report.unscored}
    if trained & refused:
        raise ApiError(422, f"rollouts both trained and rejected: {sorted(trained & refused)[:5]}", field="rejected")
    if both := unscored & (trained | refused):
        raise ApiError(422, f"rollouts both unscored and trained or rejected: {sorted(both)[:5]}", field="unscored")
    unknown = {a.rollout_id for a in report.audits} - trained - refused - unscored
    if unknown:
        raise ApiError(422, f"audits of rollouts this step neither trained nor rejected: {sorted(unknown)[:5]}",
                       field="audits")


def _claimed(db: Session, job: Job, report: StepReport, wanted: list[str], field: str) -> list[Rollout]:
    ids = set(wanted)
    rows = list(db.scalars(select(Rollout).where(Rollout.id.in_(ids), Rollout.job_id == job.id))) if ids else []
    bad = ids - {r.id for r in rows if r.status == RolloutStatus.claimed and r.claim_step == report.step}
    if bad:
        raise ApiError(409, f"rollouts not claimed for step {report.step}: {sorted(bad)[:5]}", field=field)
    spec = spec_of(job)
    too_old = [r.id for r in rows if not spec.admissible(report.step, r.version)]
    if too_old:  # cannot happen through claim(); refuse rather than record a violation
        raise ApiError(409, f"rollouts too stale for step {report.step}: {too_old[:5]}", field=field)
    return rows


def record_audits(db: Session, job: Job, body: AuditVerdicts, settings: Settings) -> int:
    """Verdicts on groups claimed for a step not committed yet: recorded, and their senders' trust moved, now.
    A group's verdict is recorded once; the step's report refuses the groups that failed."""
    ids = {a.rollout_id for a in body.audits}
    rows = {r.id: r for r in db.scalars(select(Rollout).where(Rollout.id.in_(ids), Rollout.job_id == job.id)
                                        .with_for_update())}
    bad = ids - {i for i, r in rows.items() if r.status == RolloutStatus.claimed and r.claim_step == body.step}
    if bad:
        raise ApiError(409, f"rollouts not claimed for step {body.step}: {sorted(bad)[:5]}", field="audits")
    return _record(db, rows, body.audits, body.step, settings, strike=True)


def _judge(db: Session, job: Job, report: StepReport, rows: dict[str, Rollout], settings: Settings) -> None:
    """The learner's verdicts: audits are recorded as evidence (unless they were already, with record_audits),
    refused groups go back to the pool, and each sender's trust moves (services/trust.py)."""
    early = {i for i, r in rows.items() if r.audit is not None}  # judged before the step committed
    _record(db, rows, [a for a in report.audits if a.rollout_id not in early], report.step, settings, strike=False)
    senders = {w.id: w for w in db.scalars(select(Worker).where(
        Worker.id.in_({r.worker_id for r in rows.values()})).with_for_update())} if rows else {}
    for refusal in report.rejected:
        rollout = rows[refusal.rollout_id]
        rollout.status, rollout.reason = RolloutStatus.rejected, f"refused by the learner: {refusal.reason}"
        failed = rollout.audit is AuditVerdict.failed
        rollout.claim_step = None
        rollout.reject_kind = RejectKind.audit_failed if failed else RejectKind.refused_by_learner
        if rollout.worker_id in senders:
            sender = senders[rollout.worker_id]
            sender.rejected_rollouts += 1
            if not (failed and refusal.rollout_id in early):  # a failed audit recorded early struck already
                trust.strike(db, sender, f"rollout {rollout.id}: {refusal.reason}", settings, audited=failed)
    return_prompts(db, [rows[r.rollout_id].prompt_id for r in report.rejected], from_state="submitted")


def _record(db: Session, rows: dict[str, Rollout], audits: list[AuditReport], step: int, settings: Settings,
            *, strike: bool) -> int:
    """Audits as evidence; a passed one counts for its sender, a failed one strikes it when `strike` (recorded
    before the step's report; the report's refusal strikes otherwise)."""
    senders = {w.id: w for w in db.scalars(select(Worker).where(
        Worker.id.in_({rows[a.rollout_id].worker_id for a in audits})).with_for_update())} if audits else {}
    recorded = 0
    for audit in audits:
        rollout = rows[audit.rollout_id]
        if rollout.audit is not None:
            continue
        trust.record_audit(db, rollout, step, audit.passed, audit.reason, audit.stats)
        recorded += 1
        sender = senders.get(rollout.worker_id)
        if sender is None:
            continue
        if audit.passed:
            trust.passed(db, sender, settings)
            evidence.record(db, sender, audit.stats, rollout.precision, settings)
        elif strike:
            trust.strike(db, sender, f"rollout {rollout.id}: failed its audit: {audit.reason}", settings, audited=True)
    return recorded


def _mark_trained(db: Session, job: Job, report: StepReport, rollouts: list[Rollout]) -> None:
    scored = {r.rollout_id: r for r in report.rewards}
    for r in rollouts:
        r.status, r.trained_step = RolloutStatus.trained, report.step
        if r.id in scored:
            r.rewards = scored[r.id].rewards
            r.learner_logprobs = _aligned(r, scored[r.id].learner_logprobs)
    if rollouts:
        db.execute(update(Prompt).where(Prompt.id.in_([r.prompt_id for r in rollouts]))
                   .values(state=PromptState.trained))
    release_claims(db, job.id, report.step)


def _aligned(rollout: Rollout, logprobs: list[list[float]] | None) -> list[list[float]] | None:
    """The learner's logprobs when they fit the group (one per token of each sample), else none: a trace shows
    nothing rather than values beside the wrong tokens."""
    if logprobs is None or len(logprobs) != len(rollout.samples):
        return None
    fits = all(len(lp) == len(s["token_ids"]) for lp, s in zip(logprobs, rollout.samples, strict=True))
    return logprobs if fits else None


def _metric_row(db: Session, job: Job, report: StepReport, groups: int) -> StepMetric:
    prev = db.scalar(select(StepMetric.created_at).where(StepMetric.job_id == job.id)
                     .order_by(StepMetric.step.desc()).limit(1))
    since = prev or job.started_at or job.created_at
    elapsed = max((utcnow() - since).total_seconds(), 1e-6)
    util = job.learner_busy_s / job.learner_wall_s if job.learner_wall_s > 0 else None
    return StepMetric(
        job_id=job.id, step=report.step, t_train_s=report.t_train_s, reward_mean=report.reward_mean,
        reward_std=report.reward_std, loss=report.loss, kl=report.kl, clip_frac=report.clip_frac,
        groups=groups, groups_dropped=report.groups_dropped, groups_rejected=len(report.rejected),
        groups_unscored=len(report.unscored),
        audits=len(report.audits), audit_s=report.audit_s, rollout_ids=list(report.rollout_ids),
        staleness_hist=report.staleness_hist, mismatch=[m.model_dump() for m in report.mismatch],
        tokens=report.tokens, learner_utilization=util, rollouts_per_s=groups / elapsed,
        cost_usd=job.learner_usd + job.workers_usd,
    )


def _ack(job: Job) -> StepAck:
    stop = job.status.stops_learner() or job.step >= spec_of(job).max_steps
    return StepAck(step=job.step, job_status=job.status, stop=stop, cost_usd=job.learner_usd + job.workers_usd)


LEARNER_IS = "its learner is"  # a running job's status_reason while its learner starts


def record_heartbeat(job: Job, beat: LearnerHeartbeat) -> None:
    """Liveness and utilisation; an error report marks the learner crashed, so the scheduler relaunches
    it at once (and counts the launch against the job's crash-loop limit). While the learner starts, what
    it is doing is the job's status_reason."""
    job.learner_heartbeat_at = utcnow()
    job.learner_busy_s = job.learner_busy_before_s + beat.busy_s
    job.learner_wall_s = job.learner_wall_before_s + beat.wall_s
    if beat.error is not None:
        job.learner_error, job.learner_crashed_at = beat.error, utcnow()
    elif job.status == JobStatus.running and beat.starting():
        job.status_reason = f"{LEARNER_IS} {beat.state}"[:512]
    elif job.status == JobStatus.running and (job.status_reason or "").startswith(LEARNER_IS):
        job.status_reason = None  # it started


def ack(job: Job) -> StepAck:
    return _ack(job)


def issue_learner_token(db: Session, job: Job) -> str:
    """A fresh learner token for the job; earlier ones are revoked, so a learner presumed dead (but
    maybe only partitioned) can no longer report steps once its replacement is launched."""
    auth.revoke_all(db, "learner", job.id)
    _, plain = auth.issue_token(db, "learner", job.id)
    # The next learner counts its seconds from its own start: the job's so far stay.
    job.learner_busy_before_s, job.learner_wall_before_s = job.learner_busy_s, job.learner_wall_s
    return plain
