"""The Tinker-compatible surface's own protocol: between the control plane, which answers the Tinker SDK,
and the learner host that runs its models (learner/tinker_host.py).

A Tinker call becomes a request row (a durable future) with one of these payloads; the host claims the
next request of a model it holds, runs it and reports a `HostResult`. Statuses and the rule of which
are final live here, once.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any

from pydantic import Field, StringConstraints

from .common import Finite, Logprob, Model, NoNul, Precision, ReadModel, ShortText, TokenId

ModelRef = Annotated[str, StringConstraints(min_length=1, max_length=512), NoNul]
CheckpointName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")]
HostName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$")]
Value = Annotated[float, Finite, Field(ge=-1e9, le=1e9)]
MAX_TOKENS = 32_768
# Tokens of all datums of one forward or forward_backward: bounds what one request may cost and hold a host
# for (about a minute per 4k tokens of a 135M model on a CPU); larger batches are split, gradients add up.
MAX_REQUEST_TOKENS = 65_536


class SessionStatus(StrEnum):
    active = "active"
    finished = "finished"


class ModelStatus(StrEnum):
    pending = "pending"  # no host has loaded it yet
    ready = "ready"
    parked = "parked"  # idle while others waited: its state is on its host's disk, loaded again on its next request
    failed = "failed"

    def is_terminal(self) -> bool:
        return self is ModelStatus.failed


class RequestStatus(StrEnum):
    pending = "pending"
    running = "running"
    fleet = "fleet"  # drawn by the worker fleet (api/tinker/fleet.py); the host runs it only as a fallback
    done = "done"
    failed = "failed"

    def is_terminal(self) -> bool:
        return self in (RequestStatus.done, RequestStatus.failed)


class RequestKind(StrEnum):
    create_model = "create_model"
    forward = "forward"
    forward_backward = "forward_backward"
    optim_step = "optim_step"
    save_weights = "save_weights"
    save_weights_for_sampler = "save_weights_for_sampler"
    load_weights = "load_weights"
    sample = "sample"
    audit = "audit"  # the platform's own: re-score a group a worker drew for a fleet sample request


class ErrorCategory(StrEnum):
    """Whose fault a failed request is, as the Tinker SDK's `RequestFailedError.category` names it."""

    user = "user"
    server = "server"


class LossFn(StrEnum):
    """The loss functions Echo2 computes; the Tinker SDK names more (cispo, dro, gspo, stable_reinforce)."""

    cross_entropy = "cross_entropy"
    importance_sampling = "importance_sampling"
    ppo = "ppo"


class TinkerLora(Model):
    rank: int = Field(ge=1, le=256)
    seed: int | None = Field(None, ge=0, lt=2**63)
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


class ModelSpec(Model):
    """What a host must load: a base model and, for a training model, a fresh LoRA adapter on it."""

    base_model: ModelRef
    lora: TinkerLora | None = None


class TinkerDatum(Model):
    tokens: list[TokenId] = Field(min_length=1, max_length=MAX_TOKENS)
    inputs: dict[Annotated[str, StringConstraints(max_length=64)], list[Value]] = Field(max_length=8)
    target_tokens: list[TokenId] = Field(max_length=MAX_TOKENS)


class ForwardBackwardPayload(Model):
    loss_fn: LossFn
    loss_fn_config: dict[Annotated[str, StringConstraints(max_length=64)], Value] = Field(default_factory=dict,
                                                                                         max_length=16)
    forward_only: bool = False
    data: list[TinkerDatum] = Field(min_length=1, max_length=4096)


class AdamStep(Model):
    learning_rate: float = Field(ge=0, le=10)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0, le=1)
    weight_decay: float = Field(0.0, ge=0, le=10)
    grad_clip_norm: float = Field(0.0, ge=0, le=1e6)


class SavePayload(Model):
    name: CheckpointName
    kind: Annotated[str, StringConstraints(pattern=r"^(sampler|training)$")]
    sampler_id: Annotated[str, StringConstraints(max_length=128)] | None = Field(
        None, description="The sampling session this save opens (save_weights_and_get_sampling_client).")


class LoadPayload(Model):
    """A state saved with save_weights (`tinker://{model_id}/weights/{name}`) to load; on a create_model, the
    model starts from it."""

    model_id: Annotated[str, StringConstraints(max_length=96)]
    name: CheckpointName
    optimizer: bool = Field(description="Load the optimizer's state too (else a fresh AdamW).")


class SampleParams(Model):
    max_tokens: int = Field(ge=1, le=MAX_TOKENS)
    seed: int | None = Field(None, ge=0, lt=2**63)
    temperature: float = Field(1.0, ge=0, le=100)
    top_k: int = Field(-1, ge=-1, le=1_000_000)
    top_p: float = Field(1.0, gt=0, le=1)
    stop_tokens: list[TokenId] | None = Field(None, max_length=64)
    stop_strings: list[Annotated[str, StringConstraints(min_length=1, max_length=256), NoNul]] | None = Field(
        None, max_length=16)


class SamplePayload(Model):
    checkpoint: CheckpointName | None = None
    prompt: list[TokenId] = Field(min_length=1, max_length=MAX_TOKENS)
    num_samples: int = Field(ge=1, le=128)
    params: SampleParams
    prompt_logprobs: bool = False


class HostClaim(Model):
    host: HostName
    slots: int = Field(1, ge=1, le=64)
    wait_s: float = Field(20.0, ge=0, le=60)
    holding: list[Annotated[str, StringConstraints(max_length=128)]] = Field(
        default_factory=list, max_length=64, description="The model ids the host has loaded.")
    price_per_hour: float = Field(0.0, ge=0, le=10_000, description="What an hour of this host costs its users "
                                  "($): each request it runs is billed its compute seconds at this price.")


class PublishOrder(ReadModel):
    """Where a sampler checkpoint goes for the worker fleet: version `version` of job `job_id`, published with
    its learner token like a learner's; the base model first, as version 0, when the job has none yet."""

    job_id: str
    token: str
    version: int = Field(ge=1)
    base_published: bool


class HostWork(ReadModel):
    """The next request for the host, with the model it runs on (to load it first if it is new)."""

    request_id: str
    model_id: str
    kind: RequestKind
    model: ModelSpec
    payload: dict[str, Any]
    restore: bool = Field(False, description="The model is parked on this host: load its parked state first.")
    publish: PublishOrder | None = Field(None, description="A save_weights_for_sampler: also publish the checkpoint "
                                         "as this version of the model's fleet job, for workers to sample from.")


class AuditPayload(Model):
    """A group a worker drew for a fleet sample request, to re-score under the checkpoint it claims."""

    checkpoint: CheckpointName
    version: int = Field(ge=1, description="The fleet version the group claims: the checkpoint as published then.")
    rollout_id: Annotated[str, StringConstraints(max_length=40)]
    prompt: list[TokenId] = Field(min_length=1, max_length=MAX_TOKENS)
    samples: list[tuple[list[TokenId], list[Logprob]]] = Field(min_length=1, max_length=128)
    temperature: float = Field(gt=0, le=100)
    top_p: float = Field(gt=0, le=1)
    top_k: int = Field(ge=0, le=1_000_000)
    seed: int | None = Field(None, ge=0, le=2**63, description="The request's leased base seed (sample k drew with "
                             "sample_seed(seed, k)): the audit replays the sampler with it.")
    precision: Precision = Precision.float32


class AuditVerdict(Model):
    passed: bool
    reason: ShortText = ""
    stats: dict[Annotated[str, StringConstraints(max_length=64)], Value] = Field(default_factory=dict, max_length=16)


class HostWorkReply(ReadModel):
    work: HostWork | None = None
    more: list[HostWork] = Field(default_factory=list, description="Sample requests of the same model and "
                                 "checkpoint that follow `work` in its queue, to sample in one batch with it.")
    drop: list[str] = Field(default_factory=list, description="Models to unload, and parked state to delete: "
                            "their session is over.")
    park: list[str] = Field(default_factory=list, description="Idle models to save to disk and unload: another "
                            "model waits for the slot.")


class ModelInfo(Model):
    """What the host learnt loading a model: the SDK's `get_info` and `get_tokenizer` read it."""

    tokenizer_id: ModelRef
    arch: ShortText = ""
    vocab_size: int = Field(ge=1, le=10_000_000)
    max_context_length: int = Field(ge=1, le=10_000_000)


class SampledSequence(Model):
    tokens: list[TokenId] = Field(max_length=MAX_TOKENS)
    logprobs: list[Logprob] = Field(max_length=MAX_TOKENS)
    stop_reason: Annotated[str, StringConstraints(pattern=r"^(stop|length)$")]


class SampleResult(Model):
    sequences: list[SampledSequence] = Field(max_length=128)
    prompt_logprobs: list[Logprob | None] | None = Field(None, max_length=MAX_TOKENS)


class ForwardBackwardResult(Model):
    outputs: list[dict[Annotated[str, StringConstraints(max_length=64)], list[Value]]] = Field(max_length=4096)
    metrics: dict[Annotated[str, StringConstraints(max_length=64)], Value] = Field(max_length=64)


class HostRequestState(ReadModel):
    """Whether the control plane still waits for a running request: false once its session ended (or its
    model failed), and the host stops working on it."""

    running: bool


class HostResult(Model):
    """A request's outcome: exactly one of the results its kind gives, or an error."""

    info: ModelInfo | None = None
    forward_backward: ForwardBackwardResult | None = None
    metrics: dict[Annotated[str, StringConstraints(max_length=64)], Value] | None = Field(None, max_length=64)
    step: int | None = Field(None, ge=0, le=10_000_000)
    sample: SampleResult | None = None
    audit: AuditVerdict | None = None
    published: int | None = Field(None, ge=1, description="The fleet version a save_weights_for_sampler published.")
    error: ShortText | None = None
    category: ErrorCategory = ErrorCategory.server
    seconds: float | None = Field(None, ge=0, le=86_400, description="The host's compute time for this request "
                                  "(a batch's time split evenly among its requests); the ledger bills it.")


class TinkerUsageEntry(ReadModel):
    """One finished request of the Tinker API, billed: the host's compute time at the host's price."""

    id: int
    created_at: datetime = Field(description="When the request finished.")
    session_id: str
    model_id: str
    request_id: str
    kind: RequestKind
    host: str = Field(description="The learner host that ran it.")
    tokens: int = Field(description="Tokens it processed: the data's input tokens (forward, forward_backward), or "
                                    "the prompt's plus every sampled one (sample); 0 for the others.")
    seconds: float = Field(description="The host's compute time for it.")
    price_per_hour: float = Field(description="The host's price ($/h) when it ran.")
    amount_usd: float


class TinkerUsageTotal(ReadModel):
    key: str = Field(description="The session id, model id or request kind the entries are summed by.")
    entries: int
    tokens: int
    seconds: float
    amount_usd: float


class TinkerUsage(ReadModel):
    """A user's Tinker ledger: a page of entries, and totals over every entry (not just the page)."""

    entries: list[TinkerUsageEntry]
    total_entries: int
    next_offset: int | None = Field(description="Offset of the next page; None on the last.")
    by_session: list[TinkerUsageTotal]
    by_model: list[TinkerUsageTotal]
    by_kind: list[TinkerUsageTotal]
    total_usd: float
