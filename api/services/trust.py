"""Worker trust: what the learner's audits and the door's checks do to a worker.

    probation --(passes `probation_audits` audits)--> trusted
    probation / trusted --(a strike)--> suspect --(passes `RECOVER_AFTER` audits in a row)--> trusted
    any state --(a second strike since `FORGIVE_AFTER` audits passed in a row)--> quarantined
    quarantined --(after `quarantine_s`)--> suspect (strikes cleared)
    any state, once quarantined before --(a strike)--> banned

A strike is a group the worker sent that was invalid at the door, failed its audit, or that the
learner refused to train on (poisoned loss, tokens that do not fit the model), or an alarm of the
sequential tests over its audits (api/services/evidence.py). Probation and suspect workers have every
group audited; trusted ones a sampled `audit_rate` of them. A quarantined or banned worker gets no
leases and is not activated; its rollouts still waiting to be trained are discarded and their prompts
go back to the pool, and what it was paid is clawed back (api/services/clawback.py). The evidence stays
in the `audits` table and in `trust_reason`, which its provider can read.

Providers answer for their workers. While one of a provider's workers is quarantined the provider is on
watch: its other workers become suspects (every group audited), its new ones start on probation, and none
of them becomes trusted until the watch ends; once a quarantined worker of it was deleted, a strike of a
worker registered during the watch bans, as a strike after a quarantine does (the new worker may be the deleted
one's replacement). A new worker starts with the strikes of its provider's most struck worker, as a suspect, and
its quarantine claws back the pay of the deleted workers whose strikes it carries on (`inherit_strikes`). The
strikes of a provider's workers add up where its audits fail more often than numerics explain (`_struck_alongside`).
A ban bans the provider: its other workers are banned with it and it registers no more.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta

from echo2.protocol import AuditRead, AuditVerdict, RejectKind, RolloutStatus, TrustState, WorkerRead, WorkerStatus
from sqlalchemy import ColumnElement, Select, and_, false, func, not_, or_, select, update
from sqlalchemy.orm import Session

from ..models import Audit, Provider, Rollout, Worker, utcnow
from ..settings import Settings
from . import tenancy
from .clawback import claw_back
from .fleet import unassign
from .pool import return_prompts

RECOVER_AFTER = 20  # audits passed in a row that make a suspect trusted again
# Audits passed in a row that clear a worker's strikes. Not RECOVER_AFTER: a worker that forged until its first
# strike, sent 20 honest groups and forged again was never quarantined, nor its pay for the forged groups no
# audit picked taken back; now such a cycle costs it ~500 audited honest groups (5,000 sent while trusted).
FORGIVE_AFTER = 500
STRIKES_TO_QUARANTINE = 2
# How long a deleted worker's strikes pass to its provider's next new worker: a provider waiting this long between
# two forging machines gets one trust window of forging each.
INHERIT_DAYS = 7
MAX_CHAIN = 64  # predecessors whose pay a quarantine claws back, at most
# A provider whose working workers hold STRIKES_TO_QUARANTINE strikes between them has each struck one quarantined,
# where more than this share of its workers' audits over the last INHERIT_DAYS failed: an honest fleet fails
# ~1e-4 of them (numerics), however many machines hold one old strike each; one that spends a trust cycle of each
# identity forging fails one audit in the few it passed to be trusted.
PROVIDER_FAIL_SHARE = 0.01


def audit_rate(worker: Worker, settings: Settings) -> float:
    if worker.trust == TrustState.trusted:
        return settings.audit_rate
    return 1.0


def should_audit(worker: Worker | None, rollout: Rollout, settings: Settings) -> bool:
    """Every group of a worker on probation or suspect; of a trusted one, exactly one in each window of
    W = round(1 / audit_rate) consecutive groups, at a position drawn from the worker's secret salt.
    So a worker that starts forging every group is audited within 2W - 1 of them (the rest of its
    window, whose audit may be behind it, and the next) and, a suspect then, quarantined at the next:
    within 20 groups at the default rate, always (a random draw per group would leave it unaudited for
    20 groups 12 % of the time). It cannot tell which groups are safe to forge. A pure function of
    the rows: a retried claim audits the same groups. A sender the control plane no longer knows is
    audited, and so is a group the door found suspicious (admission.duplicated)."""
    if worker is None or rollout.suspicion is not None:
        return True
    rate = audit_rate(worker, settings)
    if rate >= 1 or rate <= 0:
        return rate >= 1
    if rollout.seq is None:  # stored before groups were numbered: a draw from its id
        return int.from_bytes(hashlib.sha256(rollout.id.encode()).digest()[:8], "big") / 2**64 < rate
    index, slot = divmod(rollout.seq, settings.audit_window)
    pick = hashlib.sha256(f"{worker.audit_salt}:{index}".encode()).digest()
    return slot == int.from_bytes(pick[:8], "big") % settings.audit_window


def open_window_start(worker: Worker, settings: Settings) -> int:
    """The first group of the worker's audit window still open. A passed audit of that window is shown to
    no one but admins until the window closes (`shown_audits`, `worker_reads`): seeing it, a worker would
    know the rest of its window goes unaudited, and could forge it (about half its groups, unseen)."""
    rate = settings.audit_rate
    if worker.trust is not TrustState.trusted or not 0 < rate < 1:
        return worker.groups_numbered  # every group is audited: nothing to tell
    return worker.groups_numbered // settings.audit_window * settings.audit_window


def _in_open_window(workers: list[Worker], settings: Settings) -> ColumnElement[bool]:
    """Passed audits of the workers' open windows (an audit whose group is gone or unnumbered is in none)."""
    seq = func.coalesce(Rollout.seq, -1)
    return and_(Audit.passed, or_(false(), *(and_(Audit.worker_id == w.id, seq >= open_window_start(w, settings))
                                             for w in workers)))


def shown_audits(worker: Worker, settings: Settings) -> Select[tuple[Audit]]:
    """The worker's audits as its provider and the worker itself see them (open_window_start)."""
    return (select(Audit).outerjoin(Rollout, Rollout.id == Audit.rollout_id)
            .where(Audit.worker_id == worker.id, not_(_in_open_window([worker], settings))))


def worker_reads(db: Session, workers: list[Worker], settings: Settings, *, admin: bool,
                 user_id: str | None = None) -> list[WorkerRead]:
    """Workers as a principal sees them: audits passed in a window still open not counted but for admins; a user
    (`user_id`) sees neither another tenant's job a worker serves now, nor ids of others' jobs or rollouts."""
    reads = [WorkerRead.model_validate(w) for w in workers]
    if admin or not workers:
        return reads
    if user_id is not None:
        reads = _as_tenant(reads, tenancy.own_jobs(db, user_id))
    hidden = dict(db.execute(select(Audit.worker_id, func.count()).outerjoin(Rollout, Rollout.id == Audit.rollout_id)
                             .where(_in_open_window(workers, settings)).group_by(Audit.worker_id)).all())
    return [r.model_copy(update={"audits_passed": r.audits_passed - hidden.get(r.id, 0)}) for r in reads]


def _as_tenant(reads: list[WorkerRead], own: set[str]) -> list[WorkerRead]:
    """A worker serving another tenant's job now shows no job, version or throughput to this one."""
    out = []
    for r in reads:
        elsewhere = {"job_id": None, "version_held": None, "rollouts_per_s": 0.0} if r.job_id not in own else {}
        out.append(r.model_copy(update={**elsewhere, "trust_reason": tenancy.redact(r.trust_reason, own,
                                                                                   rollouts=True)}))
    return out


def record_audit(db: Session, rollout: Rollout, step: int, passed: bool, reason: str | None,
                 stats: dict[str, float]) -> None:
    """A re-scoring's verdict on the rollout, kept as evidence (the `audits` table its worker's provider reads)."""
    rollout.audit = AuditVerdict.passed if passed else AuditVerdict.failed
    db.add(Audit(job_id=rollout.job_id, worker_id=rollout.worker_id, rollout_id=rollout.id, version=rollout.version,
                 step=step, passed=passed, reason=reason, stats=stats))


def on_watch(provider: Provider | None, now: datetime | None = None) -> bool:
    return provider is not None and provider.watch_until is not None and provider.watch_until > (now or utcnow())


def passed(db: Session, worker: Worker, settings: Settings) -> None:
    worker.audits_passed += 1
    worker.clean_streak += 1
    if on_watch(db.get(Provider, worker.provider_id)):
        return  # no worker of a provider on watch is trusted until the watch ends
    earned = {TrustState.probation: worker.audits_passed >= settings.probation_audits,
              TrustState.suspect: worker.clean_streak >= RECOVER_AFTER}
    if earned.get(worker.trust, False):
        worker.trust = TrustState.trusted
    if worker.clean_streak >= FORGIVE_AFTER:
        worker.strikes = 0


def strike(db: Session, worker: Worker, reason: str, settings: Settings, *, audited: bool = False) -> None:
    """One more piece of evidence against the worker; moves it along the states above."""
    if audited:
        worker.audits_failed += 1
    worker.strikes += 1
    worker.clean_streak = 0
    worker.trust_reason = reason[:512]
    state = worker.trust
    if not state.can_work():
        return
    if worker.quarantines:
        ban(db, worker, f"banned (a strike after a quarantine): {reason}")
    elif _replaces(db, worker, settings):
        ban(db, worker, f"banned (a strike of a worker registered while its provider was on watch): {reason}")
    elif worker.strikes >= STRIKES_TO_QUARANTINE:
        _quarantine(db, worker, f"quarantined: {worker.strikes} strikes, latest: {reason}", settings)
    elif accomplices := _struck_alongside(db, worker):
        for other in [worker, *accomplices]:
            _quarantine(db, other, f"quarantined: its provider's workers {', '.join(w.id for w in accomplices)} "
                                   f"and {worker.id} were struck, and its audits fail too often for numerics; "
                                   f"latest: {reason}", settings)
    else:
        worker.trust = TrustState.suspect


def _quarantine(db: Session, worker: Worker, why: str, settings: Settings) -> None:
    worker.quarantined_until = utcnow() + timedelta(seconds=settings.quarantine_s)
    worker.quarantines += 1
    _shut_out(db, worker, TrustState.quarantined, why)
    _watch(db, worker, why)


def _struck_alongside(db: Session, worker: Worker) -> list[Worker]:
    """The provider's other working workers with strikes, where theirs and this one's make a quarantine's worth and
    more than PROVIDER_FAIL_SHARE of the provider's audits failed lately: a provider that registered spare
    identities up front (before any strike, so none inherits one) spent a trust cycle of each forging, each caught
    once, none quarantined, its forged groups no audit picked kept paid. A strike of its own that no failed audit
    explains (the door's, the sequential tests', a proof of possession's, a corrupt relay chunk's) counts as a failed
    audit: numerics never earn one, and spare identities each struck once by the CUSUM kept their biased groups
    paid. Such a strike stands until FORGIVE_AFTER clean audits, the share is of INHERIT_DAYS: it weighs that
    long."""
    others = list(db.scalars(select(Worker).where(
        Worker.provider_id == worker.provider_id, Worker.id != worker.id, Worker.strikes > 0,
        Worker.trust.in_(TrustState.working())).order_by(Worker.id)
        .with_for_update(skip_locked=True)))  # one being struck meanwhile is skipped: waiting for it could deadlock
    if worker.strikes + sum(o.strikes for o in others) < STRIKES_TO_QUARANTINE:
        return []
    total, failed = db.execute(
        select(func.count(), func.count().filter(not_(Audit.passed))).join(Worker, Worker.id == Audit.worker_id)
        .where(Worker.provider_id == worker.provider_id,
               Audit.created_at >= utcnow() - timedelta(days=INHERIT_DAYS))).one()
    # An inherited strike is its source's, explained where that one's was (and its next strike quarantines it).
    unexplained = sum(max(0, w.strikes - w.audits_failed) for w in [worker, *others] if w.inherited_from is None)
    return others if failed + unexplained > PROVIDER_FAIL_SHARE * (total + unexplained) else []


def inherit_strikes(db: Session, worker: Worker) -> None:
    """A provider's new worker starts with the strikes of its provider's most struck worker, as a suspect: a provider
    that replaced its struck worker (deleted it, or kept it heartbeating idle) by another was one strike from
    quarantine no more, and forged again once the new one was trusted. A deleted worker's strikes move to the new
    one, which works them off as its own (FORGIVE_AFTER); a deleted one is the provider's only while it left within
    INHERIT_DAYS. A live one keeps its own too: the provider answers for a struck machine it keeps."""
    since = utcnow() - timedelta(days=INHERIT_DAYS)
    source = db.scalars(select(Worker).where(
        Worker.provider_id == worker.provider_id, Worker.id != worker.id, Worker.strikes > 0,
        Worker.trust.in_(TrustState.working()),  # a quarantined one's watch rules new ones
        or_(Worker.status != WorkerStatus.deregistered,
            func.coalesce(Worker.last_heartbeat_at, Worker.created_at) >= since))
        .order_by(Worker.strikes.desc(), Worker.id).limit(1).with_for_update()).first()
    if source is None:
        return
    worker.strikes, worker.trust, worker.inherited_from = source.strikes, TrustState.suspect, source.id
    worker.trust_reason = (f"worker {source.id} of its provider has {source.strikes} "
                           f"strike{'s' if source.strikes > 1 else ''}: {source.trust_reason or ''}")[:512]
    if source.status == WorkerStatus.deregistered:
        source.strikes = 0  # carried on by the new one


def _predecessors(db: Session, worker: Worker) -> list[Worker]:
    """The deleted workers whose strikes it carries on, the newest first: the same provider's machine, replaced."""
    chain: list[Worker] = []
    while worker.inherited_from is not None and len(chain) < MAX_CHAIN:
        before = db.get(Worker, worker.inherited_from)
        if before is None or before.status != WorkerStatus.deregistered or before in chain:
            break
        chain.append(worker := before)
    return chain


def _replaces(db: Session, worker: Worker, settings: Settings) -> bool:
    """Whether the worker may stand in for a quarantined worker its provider deleted: registered since the provider
    was put on watch (the newest quarantine began), while a worker of it deregistered in quarantine. A provider
    that deleted its quarantined worker and registered another shed the quarantine, one replacement after another,
    never banned; an honest provider's other machines, restarted during a watch, are not such replacements."""
    provider = db.get(Provider, worker.provider_id)
    if not on_watch(provider):
        return False
    assert provider is not None and provider.watch_until is not None
    if worker.created_at < provider.watch_until - timedelta(seconds=settings.quarantine_s):
        return False
    return db.scalar(select(Worker.id).where(Worker.provider_id == provider.id,
                                             Worker.trust == TrustState.quarantined,
                                             Worker.status == WorkerStatus.deregistered).limit(1)) is not None


def ban(db: Session, worker: Worker, reason: str) -> None:
    """Ban the worker and, with it, its provider and every other worker of the provider."""
    _shut_out(db, worker, TrustState.banned, reason)
    provider = db.get(Provider, worker.provider_id, with_for_update=True)
    if provider is None or provider.banned_at is not None:
        return
    provider.banned_at, provider.standing_reason = utcnow(), f"worker {worker.id} {reason}"[:512]
    for other in db.scalars(select(Worker).where(Worker.provider_id == provider.id, Worker.id != worker.id,
                                                 Worker.trust != TrustState.banned)):
        _shut_out(db, other, TrustState.banned, f"banned with its provider: worker {worker.id} {reason}")


def _watch(db: Session, worker: Worker, reason: str) -> None:
    """A quarantine puts the worker's provider on watch until it ends (module docstring)."""
    provider = db.get(Provider, worker.provider_id, with_for_update=True)
    if provider is None:
        return
    until = worker.quarantined_until
    if provider.watch_until is None or until is not None and until > provider.watch_until:
        provider.watch_until = until
    provider.standing_reason = f"on watch: worker {worker.id} {reason}"[:512]
    # One conditional statement: a worker quarantined by another request meanwhile is not written back to suspect.
    db.execute(update(Worker).where(Worker.provider_id == provider.id, Worker.id != worker.id,
                                    Worker.trust == TrustState.trusted)
               .values(trust=TrustState.suspect, trust_reason=f"its provider is on watch: worker {worker.id} was "
                                                              "quarantined"))


def release_quarantines(db: Session, now: datetime) -> int:
    """Quarantines that ran out: back to suspect (every group audited), strikes cleared."""
    result = db.execute(update(Worker).where(Worker.trust == TrustState.quarantined,
                                             Worker.quarantined_until < now)
                        .values(trust=TrustState.suspect, strikes=0, clean_streak=0))
    return result.rowcount or 0


def audit_reads(db: Session, query: Select[tuple[Audit]], passed: bool | None, limit: int) -> list[AuditRead]:
    """Audits, newest first, each with its worker's trust state now."""
    if passed is not None:
        query = query.where(Audit.passed == passed)
    audits = list(db.scalars(query.order_by(Audit.id.desc()).limit(limit)))
    states = dict(db.execute(select(Worker.id, Worker.trust).where(Worker.id.in_({a.worker_id for a in audits}))).all())
    return [AuditRead.model_validate({**_columns(a), "worker_trust": states.get(a.worker_id)}) for a in audits]


def _columns(row: Audit) -> dict[str, object]:
    return {c.key: getattr(row, c.key) for c in Audit.__table__.columns}


def notice(worker: Worker) -> str | None:
    """What the worker is told in its heartbeat when it may not work."""
    state = worker.trust
    if state is TrustState.quarantined:
        return f"quarantined until {worker.quarantined_until:%Y-%m-%d %H:%M:%S} UTC: {worker.trust_reason}"
    if state is TrustState.banned:
        return f"banned: {worker.trust_reason}; see GET /v1/workers/{worker.id}/audits"
    return None


def _shut_out(db: Session, worker: Worker, state: TrustState, reason: str) -> None:
    worker.trust, worker.trust_reason = state, reason[:512]
    unassign(db, worker)
    discard_queued(db, worker.id, f"sender {state.value}")
    claw_back(db, worker, f"worker {state.value}: {reason}")
    for before in _predecessors(db, worker):  # the machine it replaced forged too: its unaudited groups were paid
        claw_back(db, before, f"worker {worker.id}, which carried on its strikes, {state.value}: {reason}")


def discard_queued(db: Session, worker_id: str, reason: str) -> int:
    """Rollouts of the worker not yet claimed are rejected; their prompts go back to the pool."""
    rows = list(db.scalars(select(Rollout).where(Rollout.worker_id == worker_id,
                                                 Rollout.status == RolloutStatus.accepted)
                           .with_for_update(skip_locked=True)))
    for r in rows:
        r.status, r.reason, r.reject_kind = RolloutStatus.rejected, reason, RejectKind.sender_shut_out
    return_prompts(db, [r.prompt_id for r in rows], from_state="submitted")
    return len(rows)
