"""Sampling on the worker fleet: a Tinker training model's sampler checkpoints served by rollout workers.

A LoRA training model gets a **fleet job** at its first `save_weights_for_sampler`: an Echo2 job of kind
`tinker_fleet`, with no learner and no task (`Job.tinker_model_id` its model), whose version 0 is the base
model and whose later versions are the model's sampler checkpoints, published by the learner host like a
LoRA learner's adapters. The scheduler staffs it by the capacity rule like any job (its demand: the groups
asked for in the last minute), and workers fetch its versions through the relay.

An `asample` on the newest checkpoint, while a worker serves the job, becomes a prompt of that job: the
request's token ids, its own sampling, the version it must be drawn with, the request it answers (its future
waits in status `fleet`, which the host does not claim). A worker leases it, draws the group and submits it;
the door checks it as it checks any group, against the request's own parameters. An accepted group answers
the future at once, unless its worker is new or suspect (api/services/trust.py: every group of it audited):
then the host re-scores it under the checkpoint first (learner/audit.py, an `audit` request on the model), and
a group that fails goes back to the pool while its sender takes a strike. A trusted worker's sampled audits
(one in each window of its groups) are made after delivery: a pick held back while the rest of its window was
delivered told the worker which group was audited. A delivered group is `trained`, so billing pays its worker
(scheduler/billing.py).

Nothing waits on the fleet forever: a request no worker has leased FLEET_WAIT_S after it was asked, one a
worker still holds FLEET_DEADLINE_S after (however often it renewed its lease), one whose checkpoint is no
longer the newest, and any whose job ended, are sampled by the host (`sweep`, run by host claims and scheduler
ticks); a group that arrives for it later is refused as late (no strike, no pay).

The operator turns fleet sampling off with ECHO2_TINKER_FLEET=false: a Tinker user's prompts and adapters go
to the workers that draw them, and some deployments must not send them to untrusted machines.
"""

from __future__ import annotations

from datetime import timedelta

from echo2.protocol import (
    GRPOConfig,
    JobKind,
    JobSpec,
    JobStatus,
    LoraConfig,
    Precision,
    PromptSampling,
    PromptState,
    RejectKind,
    RolloutStatus,
    TaskSpec,
    TrustState,
    WorkerStatus,
)
from echo2.protocol.tinker import (
    AuditPayload,
    AuditVerdict,
    CheckpointKind,
    ModelKind,
    ModelStatus,
    PublishOrder,
    RequestKind,
    RequestStatus,
    SampledSequence,
    SamplePayload,
    SampleResult,
)
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from ..models import Job, Lease, Prompt, Rollout, Worker, utcnow
from ..services import evidence, trust
from ..services.learning import issue_learner_token
from ..services.pool import return_prompts
from ..settings import Settings
from . import queueing, records
from .models import TinkerCheckpoint, TinkerModel, TinkerRequest, TinkerSampler

FLEET_WAIT_S = 30.0  # a fleet request no worker has leased by then is sampled by the host
FLEET_DEADLINE_S = 120.0  # nor one a worker still holds by then
# An in-flight job's S: a client saving in flight every second outpaces a worker drawing a long sample, and
# with S = 1 every group it submits would be stale; its tokens are audited under their own checkpoints anyway.
INFLIGHT_STALENESS = 8
MAX_SLOTS = 16_384  # num_samples x (prompt + max_tokens) of a fleet request: what a worker's memory was sized for
TEMPERATURES = (0.05, 2.0)  # a job's range, where the audits' tolerances were measured (docs/RELIABILITY.md)
DEMAND_WINDOW_S = 60.0
MAX_GROUP, MAX_SAMPLE = 64, 16_384  # what a worker may submit in one group (echo2.protocol.GroupSubmit)


def publish_order(db: Session, model: TinkerModel, settings: Settings, inflight: bool) -> PublishOrder | None:
    """What a save_weights_for_sampler of a LoRA training model publishes: the next version of its fleet job
    (made now if it has none), with a fresh learner token. The job serves the kind of the model's first save:
    an in-flight job (partial rollouts: a group in progress moves to each newer version between its segments)
    publishes in-flight saves only, a snapshot job snapshots only; the other kind is sampled by the host."""
    if (not settings.tinker_fleet or model.kind is not ModelKind.train or not model.lora
            or model.status is ModelStatus.failed):
        return None
    job = job_of(db, model.id) or _new_job(db, model, inflight)
    if job.status.is_terminal() or _inflight(job) != inflight:
        return None
    return PublishOrder(job_id=job.id, token=issue_learner_token(db, job), version=(job.version or 0) + 1,
                        base_published=job.version is not None)


def job_of(db: Session, model_id: str) -> Job | None:
    """The model's fleet job, if it has one."""
    return db.scalar(select(Job).where(Job.tinker_model_id == model_id))


def _inflight(job: Job) -> bool:
    return bool(job.spec.get("partial_rollouts"))


def _new_job(db: Session, model: TinkerModel, inflight: bool) -> Job:
    spec = JobSpec(name=f"Tinker sampler of {model.id}"[:128], base_model=model.base_model,
                   task=TaskSpec(name="tinker"), grpo=GRPOConfig(group_size=2, prompts_per_step=1),
                   staleness=INFLIGHT_STALENESS if inflight else 1, max_steps=100_000,
                   lora=LoraConfig(rank=model.lora["rank"]),
                   partial_rollouts=inflight)
    job = Job(owner_id=model.owner_id, name=spec.name, status=JobStatus.running, spec=spec.model_dump(mode="json"),
              kind=JobKind.tinker_fleet, tinker_model_id=model.id, started_at=utcnow())
    db.add(job)
    db.flush()
    return job


def published(db: Session, model: TinkerModel, version: int) -> None:
    """A checkpoint became `version`: the job's step follows its newest version, so with S = 1 a group of an
    older one arrives late (its request goes to the host) and retention keeps only the last two versions (and
    the base)."""
    job = job_of(db, model.id)
    if job is not None and version > job.step:
        job.step = version
    if job is not None and _inflight(job):  # an in-flight request not leased yet is drawn with the newest weights
        db.execute(update(Prompt).where(Prompt.job_id == job.id, Prompt.state == PromptState.available,
                                        Prompt.request_id.is_not(None)).values(version=version))


def fleet_job_for(db: Session, sampler: TinkerSampler, payload: SamplePayload,
                  settings: Settings) -> tuple[Job, int] | None:
    """The fleet job and version that may draw this request, or None for the host: the sampler's checkpoint
    must be the job's newest version, a worker must be serving the job, and the request must ask for what a
    worker's backend draws, may submit and the host can audit (a temperature in a job's range, no stop strings, no
    prompt logprobs, at most 64 samples of at most 16,384 tokens, MAX_SLOTS token slots in all)."""
    params = payload.params
    if not settings.tinker_fleet or sampler.checkpoint is None or params.stop_strings or payload.scores_prompt() \
            or payload.topk_sample:
        return None
    slots = payload.num_samples * (len(payload.prompt) + params.max_tokens)
    if not TEMPERATURES[0] <= params.temperature <= TEMPERATURES[1] or payload.num_samples > MAX_GROUP \
            or params.max_tokens > MAX_SAMPLE or slots > MAX_SLOTS:
        return None
    job = job_of(db, sampler.model_id)
    if job is None or job.status != JobStatus.running or _inflight(job) != payload.inflight or not _served(db, job):
        return None
    if payload.inflight:  # drawn with the newest in-flight weights, which are never older than the sampler's
        return (job, job.version) if job.version else None
    checkpoint = db.get(TinkerCheckpoint, (sampler.model_id, sampler.checkpoint, CheckpointKind.sampler))
    if checkpoint is None or checkpoint.version is None or job.version != checkpoint.version:
        return None
    return job, checkpoint.version


def _served(db: Session, job: Job) -> bool:
    return db.scalar(select(Worker.id).where(Worker.job_id == job.id, Worker.status == WorkerStatus.active)
                     .limit(1)) is not None


def add_prompt(db: Session, job: Job, version: int, request: TinkerRequest, payload: SamplePayload) -> None:
    """The request's prompt in the job's pool (the model row is locked by enqueue: indexes never collide)."""
    params = payload.params
    index = (db.scalar(select(func.max(Prompt.index)).where(Prompt.job_id == job.id)) or 0) + 1
    sampling = PromptSampling(n=payload.num_samples, max_tokens=params.max_tokens, temperature=params.temperature,
                              top_p=params.top_p, top_k=max(params.top_k, 0), stop_token_ids=params.stop_tokens)
    db.add(Prompt(job_id=job.id, index=index, text="", state=PromptState.available, epoch=0, order_key=index,
                  token_ids=list(payload.prompt), sampling=sampling.model_dump(mode="json"), version=version,
                  request_id=request.id))
    request.status = RequestStatus.fleet
    job.num_prompts += 1


def after_submit(db: Session, job: Job, lease: Lease, worker: Worker, settings: Settings) -> tuple[list[str], bool]:
    """The lease's accepted groups not handled yet (all sent by its worker): each answers its request, or waits
    for the host's audit. Returns the requests answered, and whether an audit was queued (hosts to wake). Nothing
    for a job that is not a fleet job."""
    if job.kind is not JobKind.tinker_fleet:
        return [], False
    rows = list(db.scalars(select(Rollout).where(Rollout.lease_id == lease.id,
                                                 Rollout.status == RolloutStatus.accepted, Rollout.audit.is_(None))
                           .with_for_update()))
    answered, audits = [], False
    for rollout in rows:
        prompt = db.get(Prompt, rollout.prompt_id)
        assert prompt is not None and prompt.request_id is not None
        audit = trust.should_audit(worker, rollout, settings)
        if audit and (worker.trust is not TrustState.trusted or rollout.suspicion is not None):
            if _queue_audit(db, job, rollout, prompt):
                audits = True
            else:
                _late(rollout, "its checkpoint was saved again before it could be audited")
                _to_host(prompt, db.get(TinkerRequest, prompt.request_id))
            continue
        answered += _deliver(db, rollout, prompt)
        if audit and rollout.status == RolloutStatus.trained:  # a trusted worker's window pick, audited after
            audits = _queue_audit(db, job, rollout, prompt) or audits
    return answered, audits


def _queue_audit(db: Session, job: Job, rollout: Rollout, prompt: Prompt) -> bool:
    """Ask the host to re-score the group under its checkpoints; False where one was saved again under its name
    (nothing to audit by)."""
    request = db.get(TinkerRequest, prompt.request_id)
    model = db.get(TinkerModel, job.tinker_model_id)
    versions = [_token_versions(s, rollout.version) for s in rollout.samples]
    names = _checkpoint_names(db, job, {v for row in versions for v in row})
    if request is None or model is None or names is None:
        return False
    sampling = PromptSampling.model_validate(prompt.sampling)
    spans = any(len(set(row)) > 1 or row[:1] != [rollout.version] for row in versions)
    payload = AuditPayload(checkpoint=names[rollout.version], version=rollout.version, rollout_id=rollout.id,
                           prompt=prompt.token_ids,
                           samples=[(s["token_ids"], s["logprobs"]) for s in rollout.samples],
                           temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                           seed=rollout.seed, precision=rollout.precision or Precision.float32,
                           versions=versions if spans else None, checkpoints=names if spans else {})
    rollout.audit = "pending"
    queueing.enqueue(db, model, RequestKind.audit, payload.model_dump(mode="json"), None, bounded=False)
    return True


def _token_versions(sample: dict, default: int) -> list[int]:
    runs = sample.get("versions")
    return [default] * len(sample["token_ids"]) if not runs else [v for v, n in runs for _ in range(n)]


def _checkpoint_names(db: Session, job: Job, versions: set[int]) -> dict[int, str] | None:
    """The checkpoint each version was published from; None if one of them was saved again since."""
    rows = _names(db, job, versions)
    return rows if set(rows) == versions else None


def _names(db: Session, job: Job, versions: set[int]) -> dict[int, str]:
    rows = db.execute(select(TinkerCheckpoint.version, TinkerCheckpoint.name).where(
        TinkerCheckpoint.model_id == job.tinker_model_id, TinkerCheckpoint.kind == CheckpointKind.sampler,
        TinkerCheckpoint.version.in_(versions))).all()
    return {version: name for version, name in rows}


def _runs(sample: dict, default: int, names: dict[int, str]) -> list[tuple[str, int]]:
    runs = sample.get("versions") or [(default, len(sample["token_ids"]))]
    return [(names.get(v, f"version-{v}"), n) for v, n in runs]


def _deliver(db: Session, rollout: Rollout, prompt: Prompt) -> list[str]:
    """The group answers its request, and counts as trained: its worker is paid for it. Each sequence says which
    checkpoint drew which of its tokens, and is recorded if the request asked for stability info."""
    request = db.get(TinkerRequest, prompt.request_id, with_for_update=True)
    if request is None or request.status != RequestStatus.fleet:
        _late(rollout, "its request was answered otherwise (the host took it, or the session ended)")
        return []
    rollout.status, rollout.trained_step = RolloutStatus.trained, rollout.version
    prompt.state = PromptState.trained
    job = db.get(Job, rollout.job_id)
    assert job is not None
    versions = {v for s in rollout.samples for v in _token_versions(s, rollout.version)}
    names = _names(db, job, versions)
    sequences = [SampledSequence(tokens=s["token_ids"], logprobs=s["logprobs"], stop_reason=s["finish_reason"],
                                 checkpoints=_runs(s, rollout.version, names)) for s in rollout.samples]
    if request.payload:
        records.record(db, request.id, request.owner_id, request.model_id, SamplePayload.model_validate(
            request.payload), SampleResult(sequences=sequences), worker_id=rollout.worker_id)
    request.status, request.payload = RequestStatus.done, {}
    request.result = {"sample": SampleResult(sequences=sequences).model_dump(mode="json", exclude_none=True),
                      "worker": rollout.worker_id}
    request.started_at = request.started_at or rollout.created_at
    request.finished_at = utcnow()
    return [request.id]


def audited(db: Session, request: TinkerRequest, verdict: AuditVerdict | None, settings: Settings) -> list[str]:
    """The host's verdict on a group: passed, it answers its request; failed, its sender takes a strike and
    the request goes back to the pool. None (the host could not audit it): back to the pool, no strike. A
    trusted worker's group was delivered already (`after_submit`): the verdict judges its sender only (a failed
    one is not paid, where billing has not paid it yet). Returns the requests answered."""
    rollout_id = AuditPayload.model_validate(request.payload).rollout_id
    rollout = db.get(Rollout, rollout_id, with_for_update=True)
    delivered = rollout is not None and rollout.status == RolloutStatus.trained and rollout.audit == "pending"
    if rollout is None or (rollout.status != RolloutStatus.accepted and not delivered):
        return []  # its sender was shut out meanwhile: the group was discarded and its prompt re-pooled
    if verdict is None:
        rollout.audit = None
        if not delivered:
            rollout.status = RolloutStatus.rejected
            rollout.reason = f"the learner host could not audit it: {request.error}"[:512]
            return_prompts(db, [rollout.prompt_id], from_state="submitted")
        return []
    worker = db.get(Worker, rollout.worker_id, with_for_update=True)
    trust.record_audit(db, rollout, rollout.version, verdict.passed, verdict.reason[:512], verdict.stats)
    prompt = db.get(Prompt, rollout.prompt_id)
    assert prompt is not None
    if verdict.passed:
        if worker is not None:
            trust.passed(db, worker, settings)
            evidence.record(db, worker, verdict.stats, rollout.precision, settings)
        return [] if delivered else _deliver(db, rollout, prompt)
    rollout.status, rollout.reject_kind = RolloutStatus.rejected, RejectKind.audit_failed
    rollout.reason = f"failed the host's audit: {verdict.reason}"[:512]
    if not delivered:
        return_prompts(db, [prompt.id], from_state="submitted")
    if worker is not None:
        worker.rejected_rollouts += 1
        trust.strike(db, worker, f"rollout {rollout.id}: {verdict.reason}", settings, audited=True)
    return []


def _late(rollout: Rollout, reason: str) -> None:
    """Refused without a strike or pay: the worker was not at fault, and its group answers nothing now."""
    rollout.status, rollout.reject_kind, rollout.reason = RolloutStatus.rejected, RejectKind.lease_ended, reason


def _to_host(prompt: Prompt, request: TinkerRequest | None) -> None:
    prompt.state = PromptState.host
    if request is not None and request.status == RequestStatus.fleet:
        request.status = RequestStatus.pending


def sweep(db: Session) -> None:
    """Fleet requests the host samples instead: not leased FLEET_WAIT_S after they were asked, still held by a
    worker FLEET_DEADLINE_S after, for a checkpoint that is no longer the newest, or of a job no longer running."""
    now = utcnow()
    waited, held = now - timedelta(seconds=FLEET_WAIT_S), now - timedelta(seconds=FLEET_DEADLINE_S)
    available = Prompt.state == PromptState.available
    due = ((available & (TinkerRequest.created_at < waited)) | (TinkerRequest.created_at < held)
           | (available & (Job.version != Prompt.version)) | (Job.status != JobStatus.running))
    rows = db.execute(select(Prompt, TinkerRequest).join(TinkerRequest, TinkerRequest.id == Prompt.request_id)
                      .join(Job, Job.id == Prompt.job_id)
                      .where(TinkerRequest.status == RequestStatus.fleet,
                             Prompt.state.in_((PromptState.available, PromptState.leased)), due)
                      .with_for_update(of=Prompt, skip_locked=True)).all()
    for prompt, request in rows:
        _to_host(prompt, request)


def end_jobs(db: Session, model_ids, reason: str) -> None:  # type: ignore[no-untyped-def]
    """The fleet jobs of models that are gone: their workers go back to the fleet."""
    from ..services.jobs import finish_job

    live = JobStatus.live()
    for job in db.scalars(select(Job).where(Job.tinker_model_id.in_(model_ids), Job.status.in_(live))):
        finish_job(db, job, JobStatus.succeeded, reason)


def demand(db: Session, job: Job) -> int:
    """Groups asked of the model over the last minute, whoever drew them: a model nobody samples needs no
    worker, and one whose requests the host has been sampling (no worker served yet) gets one."""
    since = utcnow() - timedelta(seconds=DEMAND_WINDOW_S)
    return db.scalar(select(func.count()).where(TinkerRequest.model_id == job.tinker_model_id,
                                                TinkerRequest.kind == RequestKind.sample,
                                                TinkerRequest.created_at >= since)) or 0
