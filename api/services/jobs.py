"""Job creation (validated task, prompts materialised, idempotency) and status transitions."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from echo2.modelinfo import context_length
from echo2.models import model_error, private_dir_of, private_model_error
from echo2.money import usd
from echo2.protocol import (
    DesiredState,
    JobCost,
    JobRead,
    JobSpec,
    JobStatus,
    JobUpdate,
    LeaseStatus,
    PauseCause,
    PromptState,
    Role,
    SamplingParams,
)
from echo2.protocol.datasets import MESSAGES, ChatTurn, item_problem
from echo2.seeds import order_key
from sqlalchemy import insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tasks import TaskError, TaskParamsError, UnknownTaskError, get_task

from .. import auth
from ..errors import ApiError
from ..models import Dataset, DatasetItem, Job, Lease, Prompt, User, Worker, utcnow
from ..settings import Settings
from . import evals, memory
from .estimate import estimate
from .relay import check_public_url
from .trackers import check_tracking

MAX_GENERATED_PROMPTS = 50_000


def create_job(
    db: Session, user: User, spec: JobSpec, idempotency_key: str | None, settings: Settings
) -> tuple[Job, bool]:
    """Return (job, created). Replaying an Idempotency-Key with the same body returns the same job."""
    request_hash = hashlib.sha256(spec.model_dump_json().encode()).hexdigest()
    if idempotency_key:
        existing = db.scalar(select(Job).where(Job.owner_id == user.id, Job.idempotency_key == idempotency_key))
        if existing is not None:
            if existing.request_hash != request_hash:
                raise ApiError(422, "Idempotency-Key was already used with a different body", field="Idempotency-Key")
            return existing, False
    items, held_out = training_items(db, user, spec)
    check_terms(user, spec, settings)
    check_references(spec, settings)
    learner_memory = memory.check(db, spec, settings)
    if spec.learner.price_per_hour is None:
        spec.learner.price_per_hour = settings.learner_price_per_hour
    job = Job(
        owner_id=user.id,
        name=spec.name,
        spec=spec.model_dump(mode="json"),
        num_prompts=len(items),
        idempotency_key=idempotency_key,
        request_hash=request_hash,
        estimate_usd=estimate(db, spec, settings).cost_usd,
        learner_memory_gib=learner_memory.per_gpu_gib if learner_memory is not None else None,
    )
    try:
        with db.begin_nested():  # a concurrent replay of the same key may insert first
            db.add(job)
    except IntegrityError:
        existing = db.scalar(select(Job).where(Job.owner_id == user.id, Job.idempotency_key == idempotency_key))
        if existing is None or existing.request_hash != request_hash:
            raise ApiError(422, "Idempotency-Key was already used with a different body",
                           field="Idempotency-Key") from None
        return existing, False
    rows = [
        {"job_id": job.id, "index": i, "text": text, "reference": ref, "context": context,
         "order_key": order_key(spec.seed, job.id, i, 0),
         "state": PromptState.available if i < len(items) else PromptState.eval}
        for i, (text, ref, context) in enumerate(items + held_out)
    ]
    db.execute(insert(Prompt), rows)
    return job, True


def check_context(spec: JobSpec, settings: Settings) -> None:
    """A job whose max_new_tokens fills its model's whole context (where the control plane has the model's config
    at hand) leaves no room for a prompt: every sample would stop at the context, short of what was asked."""
    found = memory.config_of(spec.base_model, settings)
    context = context_length(lambda _: found[0]) if found is not None else None
    if context is not None and spec.grpo.max_new_tokens >= context:
        raise ApiError(422, f"grpo.max_new_tokens is {spec.grpo.max_new_tokens}, but {spec.base_model} holds "
                            f"{context} tokens, prompt and completion together: set it below {context}, leaving "
                            "room for the prompts (a sample stops where the context ends)", field="grpo.max_new_tokens")


# (text, reference, chat context: the turns before a chat item's last user turn, else None)
Items = list[tuple[str, str | None, list[dict[str, str]] | None]]


def check_terms(user: User, spec: JobSpec, settings: Settings) -> None:
    """What a tenant may not set for itself, only an admin: a learner price below the platform's (the learner
    would run, and the job's budget and the daily quota count it, for less), and a priority above 0 (it orders
    every tenant's jobs for learner slots and workers)."""
    if user.role is Role.admin:
        return
    price = spec.learner.price_per_hour
    if price is not None and price < settings.learner_price_per_hour:
        raise ApiError(422, f"learner.price_per_hour is ${price:g}/h, below the platform's "
                            f"${settings.learner_price_per_hour:g}/h: leave it out", field="learner.price_per_hour")
    if spec.priority > 0:
        raise ApiError(403, f"priority {spec.priority}: a priority above 0 puts a job ahead of other tenants' and "
                            "is an admin's to give; yours may be 0 or lower (to let your other jobs go first)",
                       field="priority")


def check_references(spec: JobSpec, settings: Settings) -> None:
    """What a spec points at on the platform's side: a model the learner host can load (with `model_check`
    "host", the control plane sees the learner hosts' disks, Hugging Face cache and network; with "names", only
    built-in names are checked) and not a model folder inside Echo2's own data (the learner host refuses it
    too; here the user hears at once), and, in production, a task endpoint (http_reward,
    http_env: called from inside the platform) only at a public address, never at the platform's own
    services or a cloud's metadata endpoint; and a tracker outside the platform's own data (trackers.py)."""
    private = private_dir_of(spec.base_model, (settings.data_dir,))
    if private is not None:
        raise ApiError(422, private_model_error(spec.base_model, private), field="base_model")
    problem = model_error(spec.base_model, settings.hf_hub_cache, look=settings.model_check == "host")
    if problem is not None:
        raise ApiError(422, problem, field="base_model")
    check_context(spec, settings)
    check_tracking(spec, settings)
    url = (spec.task.params or {}).get("url")
    if settings.env == "production" and isinstance(url, str):
        check_public_url(url, "task.params.url", "the platform calls only public addresses for a job's task")


def training_items(db: Session, user: User, spec: JobSpec) -> tuple[Items, Items]:
    """(training prompts, held-out prompts) of a spec, or the 422 that refuses it: everything a job
    creation checks beyond the spec's own validation (also for an estimate, which creates nothing)."""
    items, held_out = _prompt_items(db, user, spec)
    if not items and held_out:
        raise ApiError(422, "no prompt is left to train on (the held-out share took them all)", field="eval.fraction")
    if not items:
        raise ApiError(422, f"{_items_field(spec)} holds no prompt: give at least grpo.prompts_per_step = "
                            f"{spec.grpo.prompts_per_step}", field=_items_field(spec))
    return _fill_a_step(items, len(held_out), spec), held_out


def _fill_a_step(items: Items, held_out: int, spec: JobSpec) -> Items:
    """The training prompts, or the 422 when they are fewer than one step needs: the learner would wait for
    the missing groups forever. With `reuse_prompts` they are repeated (each a group of its own) to fill it."""
    need = spec.grpo.prompts_per_step
    if len(items) >= need:
        return items
    if spec.reuse_prompts:
        return items * -(-need // len(items))
    synthetic = spec.prompts is None and spec.dataset_id is None
    one = len(items) == 1
    have = f"{len(items)} training prompt{'' if one else 's'}{_besides(held_out, synthetic)} {'is' if one else 'are'}"
    more = f"Set num_prompts to {need} or more" if synthetic else "Give more prompts"
    raise ApiError(422, f"{have} fewer than one step's "
                   f"grpo.prompts_per_step = {need}: the job would wait for the rest forever. {more}, "
                   f"set grpo.prompts_per_step to {len(items)} or less, or set reuse_prompts to true to train on "
                   "each of them several times a step", field="grpo.prompts_per_step")


def _besides(held_out: int, synthetic: bool) -> str:
    """The held-out prompts beside the training ones, and where they come from: a share of the prompts given
    (eval.fraction), or a synthetic task's own problems it never trains on, generated apart from its num_prompts
    (up to eval.size); eval.fraction changes nothing there."""
    if not held_out:
        return ""
    where = "the task's own held-out problems, up to eval.size" if synthetic else "eval.fraction"
    return f" ({held_out} more held out for evaluation, {where})"


def _prompt_items(db: Session, user: User, spec: JobSpec) -> tuple[Items, Items]:
    """(training prompts, held-out prompts) as (text, reference)."""
    try:
        adapter = get_task(spec.task.name)
    except UnknownTaskError as exc:
        raise ApiError(422, str(exc), field="task.name") from None
    if spec.partial_rollouts and adapter.multi_turn:  # an episode's turns are not yet split into versioned segments
        raise ApiError(422, f"task {adapter.name} is multi-turn, and partial_rollouts works with single-turn tasks "
                       "only for now: set partial_rollouts to false", field="partial_rollouts")
    try:
        params = adapter.parse_params(spec.task.params)
    except TaskParamsError as exc:
        where, reason = exc.errors[0]
        if where == "params":  # a check across several parameters (the task's model validator) names none
            raise ApiError(422, f"task.params: {reason}", field="task.params") from None
        raise ApiError(422, f"{where}: {reason}", field=f"task.params.{where}") from None
    raw = _raw_items(db, user, spec)
    if raw is None:
        if adapter.needs_dataset:
            raise ApiError(422, f"task {adapter.name} needs prompts: give dataset_id or prompts", field="dataset_id")
        count = spec.num_prompts or min(spec.max_steps * spec.grpo.prompts_per_step, MAX_GENERATED_PROMPTS)
        seed = secrets.randbits(62) if adapter.secret_references else spec.seed  # see TaskAdapter
        try:
            generated = adapter.generate_prompts(params, seed, count)
            held = adapter.eval_prompts(params, seed, spec.eval.size)
        except TaskError as exc:
            raise ApiError(422, str(exc), field="task.params") from None
        return [(p.text, p.reference, None) for p in generated], [(p.text, p.reference, None) for p in held]
    prompts = [_from_item(adapter, params, item, i, spec) for i, item in enumerate(raw)]
    if adapter.multi_turn and any(context is not None for _, _, context in prompts):
        raise ApiError(422, f"task {adapter.name} is multi-turn: its environment starts each episode, so chat items "
                       "(messages) cannot be used with it; give plain prompts", field=_items_field(spec))
    if adapter.multi_turn:  # the learner's evaluation answers single turns; episodes are not evaluated yet
        return prompts, []
    return evals.split_items(prompts, spec)


def _raw_items(db: Session, user: User, spec: JobSpec) -> list[dict[str, Any]] | None:
    if spec.prompts is not None:
        return [p.item for p in spec.prompts]
    if spec.dataset_id is None:
        return None
    dataset = db.get(Dataset, spec.dataset_id)
    if dataset is None or (dataset.owner_id != user.id and user.role != "admin"):
        raise ApiError(404, f"dataset {spec.dataset_id} not found", field="dataset_id")
    return list(db.scalars(select(DatasetItem.data).where(DatasetItem.dataset_id == dataset.id)
                           .order_by(DatasetItem.index)))


def _items_field(spec: JobSpec) -> str:
    return "prompts" if spec.prompts is not None else "dataset_id"


def _from_item(adapter: Any, params: Any, item: dict[str, Any], i: int,
               spec: JobSpec) -> tuple[str, str | None, list[dict[str, str]] | None]:
    """A prompt from an item; a chat item (`messages`) gives the task its last user turn as the prompt's text,
    and keeps the turns before it as the prompt's context (rendered by the model's chat template)."""
    field = f"prompts.{i}" if spec.prompts is not None else f"dataset_id (item {i})"
    where = field if spec.prompts is not None else f"item {i}"  # what the detail starts with: said once
    context = None
    if MESSAGES in item:
        problem = item_problem(item)
        if problem:
            raise ApiError(422, f"{where}: {problem}", field=field)
        key = adapter.prompt_key(params)
        if key is None:
            raise ApiError(422, f"{where}: task {adapter.name} reads no prompt text from an item, so it cannot "
                           "take chat items (messages)", field=field)
        turns = [t.model_dump(mode="json") if isinstance(t, ChatTurn) else {"role": t["role"], "content": t["content"]}
                 for t in item[MESSAGES]]
        item = {k: v for k, v in item.items() if k != MESSAGES} | {key: turns[-1]["content"]}
        context = turns[:-1] or None
    try:
        prompt = adapter.prompt_from_item(item, params)
    except (TaskError, KeyError, ValueError, TypeError) as exc:
        raise ApiError(422, f"{where}: {exc}", field=field) from None
    return prompt.text, prompt.reference, context


def job_read(job: Job) -> JobRead:
    cost = JobCost(learner_usd=job.learner_usd, workers_usd=job.workers_usd,
                   total_usd=job.learner_usd + job.workers_usd)
    return JobRead.model_validate(
        {**{c: getattr(job, c) for c in ("id", "name", "owner_id", "kind", "status", "status_reason", "queue_position",
                                         "paused_for", "memory_need_gb", "learner_memory_gib", "step", "version",
                                         "final_version", "num_prompts",
                                         "reward_mean", "created_at", "started_at", "finished_at")},
         "spec": job.spec, "cost": cost}
    )


def finish_job(db: Session, job: Job, status: JobStatus, reason: str | None) -> None:
    """Move a job to a terminal state; refuse if it already is in one. Frees its workers and leases, and
    revokes its learner tokens."""
    if job.status.is_terminal():
        raise ApiError(409, f"job {job.id} is already {job.status}; a finished job cannot change state")
    job.status, job.status_reason, job.finished_at = status, reason, utcnow()
    job.queue_position = job.paused_for = None
    auth.revoke_all(db, "learner", job.id)  # a finished job's learner can do nothing more
    _free_fleet(db, job)


def pause_job(db: Session, job: Job, cause: PauseCause, reason: str) -> None:
    """Stop a job without ending it: its learner stops at its next step or heartbeat (the ack says
    paused), its workers and leases go back, and `resume_job` queues it for a new learner, which
    resumes from the job's checkpoint. `cause` is "budget" (resumed when the budget is raised) or
    "quota" (resumed by the scheduler once the owner's daily spending allows)."""
    job.status, job.paused_for, job.status_reason = JobStatus.paused, cause, reason[:512]
    job.learner_launched_at = job.queue_position = None
    _free_fleet(db, job)


def resume_job(job: Job) -> None:
    """Back to the queue; the scheduler launches its learner when a slot (and the owner's quota) allows. A
    Tinker fleet job has no learner to wait for (its host publishes): it runs again at once."""
    job.status = JobStatus.queued if job.kind.has_learner else JobStatus.running
    job.paused_for, job.status_reason = None, None
    job.learner_launched_at = job.learner_crashed_at = None
    job.learner_failures, job.learner_failure_step = 0, None


def _free_fleet(db: Session, job: Job) -> None:
    """Its workers go idle, its active leases end, its leased prompts return to the pool."""
    db.execute(
        update(Worker).where(Worker.job_id == job.id).values(job_id=None, desired=DesiredState.idle, active_since=None)
    )
    db.execute(
        update(Lease).where(Lease.job_id == job.id, Lease.status == LeaseStatus.active)
        .values(status=LeaseStatus.released, finished_at=utcnow())
    )
    db.execute(
        update(Prompt).where(Prompt.job_id == job.id, Prompt.state == PromptState.leased)
        .values(state=PromptState.available, lease_id=None)
    )


def resume_by_owner(job: Job) -> None:
    """Resume a job its task paused (paused_for "reward") once its owner fixed the task: back in the queue, and
    its new learner resumes from its checkpoint where it stopped. Other pauses have their own way back."""
    if job.status != JobStatus.paused:
        raise ApiError(409, f"job {job.id} is {job.status}, not paused")
    if job.paused_for is PauseCause.budget:
        raise ApiError(409, f"job {job.id} is paused by its budget: raise budget_usd, which resumes it: echo2 jobs "
                       f"budget {job.id} USD (PATCH /v1/jobs/{job.id})")
    if job.paused_for is PauseCause.quota:
        raise ApiError(409, f"job {job.id} is paused by its owner's daily quota: it resumes by itself as the last 24 "
                       "hours' spending falls")
    job.reward_failures = 0
    resume_job(job)


def update_job(job: Job, update: JobUpdate) -> None:
    """Change the budget; a job its budget paused is queued again once the new one leaves money to spend."""
    if job.status.is_terminal():
        raise ApiError(409, f"job {job.id} is already {job.status}; a finished job cannot change")
    job.spec = spec_of(job).model_copy(update={"budget_usd": update.budget_usd}).model_dump(mode="json")
    if job.paused_for is not PauseCause.budget:
        return
    why = over_budget(job)
    if why is None:
        resume_job(job)
    else:
        job.status_reason = why


BUDGET_SLACK_USD = 1e-6  # left of a budget that counts as spent: a payment capped at what is left adds up in floats


def budget_left(job: Job, spec: JobSpec) -> float | None:
    """Dollars the job's budget has left (0 once less than BUDGET_SLACK_USD is), or None for a job without one:
    what stops the job (over_budget) and what bounds a worker's payment (scheduler/billing.py)."""
    if spec.budget_usd is None:
        return None
    left = spec.budget_usd - job.learner_usd - job.workers_usd
    return left if left > BUDGET_SLACK_USD else 0.0


def over_budget(job: Job) -> str | None:
    """Why the job's budget stops it, or None while it has money left."""
    spec = spec_of(job)
    if budget_left(job, spec) != 0.0:
        return None
    return (f"budget of {usd(spec.budget_usd)} exhausted ({usd(job.learner_usd + job.workers_usd)} spent) at step "
            f"{job.step}: raise budget_usd to resume it: echo2 jobs budget {job.id} USD (PATCH /v1/jobs/{job.id})")


def spec_of(job: Job) -> JobSpec:
    """The job's spec, parsed once per loaded row: the hot routes (leases, submissions, heartbeats) read it
    several times a request. Keyed on the stored dict itself, which is only ever replaced whole (a reload
    or update_job), never changed in place; callers must not change the returned spec either."""
    memo = getattr(job, "_spec_memo", None)
    if memo is None or memo[0] is not job.spec:
        memo = (job.spec, JobSpec.model_validate(job.spec))
        job._spec_memo = memo  # type: ignore[attr-defined]  # not a column: per instance, per loaded spec
    return memo[1]


def valid_spec(job: Job) -> JobSpec | None:
    """The job's spec, or None where it no longer validates (written by an older release, or by hand): for the
    scheduler's parts outside its per-job isolation (reconcile.Trouble, which records why on the job), so that
    one job's spec never stops a tick for every other."""
    try:
        return spec_of(job)
    except ValueError:
        return None


def sampling_of(spec: JobSpec) -> SamplingParams:
    g = spec.grpo
    return SamplingParams(group_size=g.group_size, max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                          top_p=g.top_p, top_k=g.top_k, partial_rollouts=spec.partial_rollouts)
