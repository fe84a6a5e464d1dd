"""The Tinker-compatible surface's own protocol: between the control plane, which answers the Tinker SDK,
and the learner host that runs its models (learner/tinker/host.py).

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
TEN_YEARS_S = 10 * 365 * 86_400  # the longest ttl_seconds the SDK documents (the shortest is an hour)


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


class ModelKind(StrEnum):
    train = "train"  # a training client's model
    sample = "sample"  # a base-model sampler's
    copy = "copy"  # a training run made by copy_weights: holds copied states, cannot be trained on


class CheckpointKind(StrEnum):
    sampler = "sampler"  # save_weights_for_sampler: weights to sample with (`sampler_weights/{name}`)
    training = "training"  # save_state: weights and optimiser state to load again (`weights/{name}`)

    @property
    def segment(self) -> str:
        """Its folder in a `tinker://` path."""
        return "sampler_weights" if self is CheckpointKind.sampler else "weights"


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
    drop_checkpoint = "drop_checkpoint"  # a deleted (or expired) sampler checkpoint: the host forgets its weights
    audit = "audit"  # the platform's own: re-score a group a worker drew for a fleet sample request


class ErrorCategory(StrEnum):
    """Whose fault a failed request is, as the Tinker SDK's `RequestFailedError.category` names it."""

    user = "user"
    server = "server"


class LossFn(StrEnum):
    """The loss functions Echo2 computes (learner/tinker/losses.py states each); the SDK's `custom` (a loss graph
    run server side) is not one of them."""

    cross_entropy = "cross_entropy"
    importance_sampling = "importance_sampling"
    ppo = "ppo"
    cispo = "cispo"
    dro = "dro"
    gspo = "gspo"
    stable_reinforce = "stable_reinforce"

    @property
    def config_keys(self) -> tuple[str, ...]:
        """The loss_fn_config keys it reads (learner/tinker/losses.py): anything else is refused at the door."""
        clip = ("clip_low_threshold", "clip_high_threshold")
        return {LossFn.ppo: clip, LossFn.cispo: clip, LossFn.gspo: clip, LossFn.dro: ("beta",),
                LossFn.stable_reinforce: ("truncation",)}.get(self, ())


# The input of stable_reinforce the control plane fills in: the logprob the sampler recorded for each target token
# (record_stability_info), found through the datum's provenance spans. A client cannot send it.
RECORDED_LOGPROBS = "recorded_logprobs"


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
    kind: CheckpointKind
    sampler_id: Annotated[str, StringConstraints(max_length=128)] | None = Field(
        None, description="The sampling session this save opens (save_weights_and_get_sampling_client).")
    inflight: bool = Field(False, description="An in-flight save: the model's in-flight samplers move to these "
                           "weights, and samples they are drawing continue on them.")
    ttl_seconds: int | None = Field(None, ge=3600, le=TEN_YEARS_S, description="The checkpoint expires then (None: "
                                    "kept until deleted, or for a sampler checkpoint until its model ends).")


class StateUpload(ReadModel):
    """Where a host sends a saved state, and what the control plane stored."""

    path: str
    size_bytes: int = Field(ge=0)
    sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class LoadPayload(Model):
    """A state saved with save_weights (`tinker://{model_id}/weights/{name}`) to load; on a create_model, the
    model starts from it."""

    model_id: Annotated[str, StringConstraints(max_length=96)]
    name: CheckpointName
    optimizer: bool = Field(description="Load the optimizer's state too (else a fresh AdamW).")
    sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] | None = Field(
        None, description="The state is stored by the control plane with this digest: a host without it on its "
                          "disk downloads it from there (GET /v1/tinker/host/states/{sha256}).")


class SampleParams(Model):
    max_tokens: int = Field(ge=1, le=MAX_TOKENS)
    seed: int | None = Field(None, ge=0, lt=2**63)
    temperature: float = Field(1.0, ge=0, le=100)
    top_k: int = Field(-1, ge=-1, le=1_000_000)
    top_p: float = Field(1.0, gt=0, le=1)
    stop_tokens: list[TokenId] | None = Field(None, max_length=64)
    stop_strings: list[Annotated[str, StringConstraints(min_length=1, max_length=256), NoNul]] | None = Field(
        None, max_length=16)


Run = tuple[Annotated[str, StringConstraints(max_length=128)], Annotated[int, Field(ge=0, le=MAX_TOKENS)]]
MAX_TOPK = 64  # top-k logprobs and alternative prompt tokens per position


class SampleProgress(Model):
    """An in-flight request between two of its segments on the host: each row's tokens so far, their logprobs,
    which checkpoint drew which (runs of [checkpoint, tokens], oldest first), whether it stopped at a stop token
    and whether it is done; and what the request asked of its prompt, scored on the first segment."""

    rows: list[tuple[list[TokenId], list[Logprob], list[Run], bool, bool]] = Field(max_length=128)
    seed: int = Field(ge=0, lt=2**63)
    prompt_logprobs: list[Logprob | None] | None = Field(None, max_length=MAX_TOKENS)
    topk_prompt: list[list[tuple[TokenId, Logprob]] | None] | None = Field(None, max_length=MAX_TOKENS)
    alt: tuple[list[list[TokenId]], list[list[Logprob]]] | None = None
    topk: list[list[list[tuple[TokenId, Logprob]] | None]] | None = Field(None, max_length=128)
    seconds: float = Field(0.0, ge=0, le=86_400 * 7, description="Compute time of the segments so far (billed at "
                           "the end).")


class SamplePayload(Model):
    checkpoint: CheckpointName | None = None
    prompt: list[TokenId] = Field(min_length=1, max_length=MAX_TOKENS)
    num_samples: int = Field(ge=1, le=128)
    params: SampleParams
    prompt_logprobs: bool = False
    inflight: bool = Field(False, description="An in-flight sampler's request: it is drawn with the model's newest "
                           "in-flight checkpoint, segment by segment (newer ones as they are saved).")
    record: bool = Field(False, description="record_stability_info: keep every sequence for stable_reinforce.")
    topk_prompt: int = Field(0, ge=0, le=MAX_TOPK, description="topk_prompt_logprobs")
    topk_sample: int = Field(0, ge=0, le=MAX_TOPK, description="topk_sample_logprobs")
    prompt_last_n: int | None = Field(None, ge=1, le=MAX_TOKENS, description="prompt_logprobs_last_n")
    alt_k: int = Field(0, ge=0, le=MAX_TOPK, description="prompt_alt_tokens_k")
    progress: SampleProgress | None = Field(None, description="In flight: what earlier segments drew.")

    def scores_prompt(self) -> bool:
        return self.prompt_logprobs or self.topk_prompt > 0 or self.alt_k > 0


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
    versions: list[list[Annotated[int, Field(ge=0)]]] | None = Field(
        None, max_length=128, description="An in-flight group: each sample's per-token versions (every token is "
                                          "audited under its own); None: every token is `version`'s.")
    checkpoints: dict[int, CheckpointName] = Field(default_factory=dict, max_length=64, description="The checkpoint "
                                                   "each version in `versions` was published from.")


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
    checkpoints: list[Run] | None = Field(None, max_length=MAX_TOKENS, description="Which checkpoint drew which "
                                          "tokens: [name, count] runs, oldest first (None: the request's one).")
    topk: list[list[tuple[TokenId, Logprob]] | None] | None = Field(None, max_length=MAX_TOKENS)


class SampleResult(Model):
    sequences: list[SampledSequence] = Field(max_length=128)
    prompt_logprobs: list[Logprob | None] | None = Field(None, max_length=MAX_TOKENS)
    topk_prompt: list[list[tuple[TokenId, Logprob]] | None] | None = Field(None, max_length=MAX_TOKENS)
    alt_tokens: list[list[TokenId]] | None = Field(None, max_length=MAX_TOKENS)
    alt_logprobs: list[list[Logprob]] | None = Field(None, max_length=MAX_TOKENS)


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
    progress: SampleProgress | None = Field(None, description="An in-flight sample that is not finished: what it "
                                            "drew so far; the request runs again after the model's next requests.")
    state: StateUpload | None = Field(None, description="A save_weights whose state the host uploaded.")
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
