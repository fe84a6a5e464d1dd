"""Jobs: the validated training configuration a user submits, and what the server reports back."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, model_validator

from .common import (
    Backend,
    Id,
    JobKind,
    JobStatus,
    Key,
    Model,
    Name,
    NoNul,
    ParamValue,
    Price,
    PromptState,
    ReadModel,
)
from .datasets import Item

ModelRef = Annotated[str, StringConstraints(min_length=1, max_length=512, strip_whitespace=True), NoNul]


class LossAggregation(StrEnum):
    """How token losses are averaged (see learner/objective.py)."""

    token_mean = "token_mean"  # DAPO: mean over every completion token in the batch
    seq_mean = "seq_mean"  # original GRPO: mean per sequence, then over sequences
    max_len = "max_len"  # Dr.GRPO: sum per sequence / max_new_tokens


class Device(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class TaskSpec(Model):
    """A registered task adapter and its parameters (validated by the adapter's own schema)."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=64), NoNul] = Field(
        description="Task adapter name, e.g. `arithmetic`, `gsm8k`, `exact_match`, `regex`, `http_reward`."
    )
    params: dict[Key, ParamValue] = Field(
        default_factory=dict, max_length=32, description="Adapter parameters; see GET /v1/tasks."
    )


class LrSchedule(StrEnum):
    constant = "constant"
    linear = "linear"  # from lr down to lr * min_lr_ratio at max_steps
    cosine = "cosine"  # likewise, along a half cosine


class Correction(StrEnum):
    """An importance-sampling correction for the gap between the policy that sampled (the behaviour
    logprobs workers report) and the one the learner trains (learner/objective.py, step 2b). w is the
    ratio of the learner's probability of a token, on the weights it publishes and before the step, to the
    behaviour probability; its gradient is not taken."""

    none = "none"  # the ratio against the behaviour logprobs, capped for stale samples (ratio_cap)
    tis = "tis"  # truncated IS: weight min(w, high)
    mis = "mis"  # masked IS: weight w where w <= high, else 0 (the token or sequence is dropped)
    icepop = "icepop"  # two-sided mask: weight w where low <= w <= high, else 0


class CorrectionLevel(StrEnum):
    token = "token"  # w of each token
    sequence = "sequence"  # w of a sample: the product of its tokens' w, applied to all of them


class GRPOConfig(Model):
    group_size: int = Field(8, ge=2, le=64, description="G: samples generated per prompt.")
    prompts_per_step: int = Field(16, ge=1, le=1024, description="Prompt groups per learner step (R).")
    lr: float = Field(1e-5, gt=0, le=1.0, description="AdamW learning rate.")
    eps_low: float = Field(0.2, ge=0, lt=1.0, description="Lower clip: ratio >= 1 - eps_low (which stays above 0).")
    eps_high: float = Field(0.28, ge=0, le=10.0, description="Upper clip: ratio <= 1 + eps_high.")
    ratio_cap: float = Field(2.0, ge=1.0, le=100.0, description="Cap on the importance ratio of stale samples.")
    kl_coef: float = Field(0.0, ge=0, le=10.0, description="Coefficient of the KL penalty to the base model.")
    loss_agg: LossAggregation = LossAggregation.token_mean
    scale_rewards: bool = Field(True, description="Divide group advantages by the group's reward std.")
    max_new_tokens: int = Field(256, ge=1, le=8192)
    temperature: float = Field(1.0, ge=0.05, le=2.0)
    top_p: float = Field(1.0, gt=0, le=1.0)
    top_k: int = Field(0, ge=0, le=100_000, description="Sample from the k most likely tokens only (0: all).")
    correction: Correction = Field(Correction.none, description=(
        "Off-policy correction. `none`: PPO's ratio rho = exp(min(logp - logq, log ratio_cap)) against the "
        "behaviour logprobs logq (cap for stale samples only). Otherwise the learner's own logprobs before the "
        "step, on the weights it publishes (logp_old), are the ratio's denominator, rho = exp(logp - logp_old), "
        "and each token's loss is multiplied by c(w), w = exp(logp_old - logq) (per token, or per sample: "
        "exp(sum of the sample's logp_old - logq)): `tis` c = min(w, correction_high); `mis` c = w if "
        "w <= correction_high else 0; `icepop` c = w if correction_low <= w <= correction_high else 0."))
    correction_level: CorrectionLevel = Field(CorrectionLevel.token, description="Apply the correction to "
                                              "each token's w, or to each sample's (the product of its tokens').")
    correction_low: float = Field(0.5, gt=0, le=1.0, description="`icepop`: tokens (samples) with w below this "
                                  "are masked.")
    correction_high: float = Field(2.0, ge=1.0, le=1e4, description="`tis`: w is truncated to this; `mis`, "
                                   "`icepop`: tokens (samples) with w above it are masked.")
    support_replay: bool = Field(False, description="With top-k/top-p sampling, take the learner's logprob of a "
                                 "token over the support the sampler drew from, replayed on the learner's logits "
                                 "(echo2.sampler.support): log p(y) - log sum_{i in support} p(i), so the gradient "
                                 "is the truncated policy's; a token outside the replayed support gets weight 0 "
                                 "(counted as masked). Needs top_k > 0 or top_p < 1.")
    micro_batch_tokens: int = Field(
        16_384, ge=64, le=1_048_576, description="Padded tokens per forward pass; gradient accumulation beyond."
    )
    warmup_steps: int = Field(0, ge=0, le=100_000, description="Linear learning-rate warm-up.")
    lr_schedule: LrSchedule = Field(LrSchedule.constant, description="The learning rate after warm-up.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1.0, description="Where a linear or cosine schedule ends, "
                                "as a share of lr.")
    adam_betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field(
        (0.9, 0.999), description="AdamW's (beta1, beta2).")
    adam_eps: float = Field(1e-8, gt=0, le=1e-2)
    weight_decay: float = Field(0.0, ge=0, le=1.0, description="AdamW's decoupled weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, le=1e6, description="Gradient clipping norm.")

    def check_correction(self) -> None:
        """Refuse a correction the learner would not have the inputs for (JobSpec's validation calls it)."""
        if self.support_replay and self.top_k == 0 and self.top_p >= 1.0:
            raise ValueError("grpo.support_replay replays the sampler's top-k/top-p support, and this job samples "
                             "from the whole vocabulary (top_k 0, top_p 1): there is no support to replay; set "
                             "top_k or top_p, or support_replay false")
        if self.correction is Correction.icepop and self.correction_low >= self.correction_high:
            raise ValueError(f"grpo.correction `icepop` keeps w in [correction_low, correction_high]; "
                             f"{self.correction_low} >= {self.correction_high} keeps nothing")


class EvalConfig(Model):
    """Held-out evaluation: the learner scores its own weights on prompts never leased for training, greedy
    and sampled at the job's temperature, before the first step, every `every` steps and after the last."""

    size: int = Field(64, ge=0, le=4096, description="Held-out prompts evaluated (0: no evaluation).")
    every: int = Field(10, ge=0, le=100_000, description="Evaluate every this many steps (0: only before and after).")
    fraction: float = Field(0.1, gt=0, lt=1, description="For a dataset or inline prompts: the share of distinct "
                            "prompts held out (at most `size`; every copy of a repeated prompt is held out or none "
                            "is). Synthetic tasks generate held-out problems disjoint from the "
                            "training ones by construction.")


class WeightDtype(StrEnum):
    auto = "auto"  # the base model's own dtype (its config.json): bfloat16 for most released models
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Rounding(StrEnum):
    """How the learner's float32 master weights become the published (and computed-on) weights."""

    auto = "auto"  # dithered for bfloat16 versions in a single-process learner, nearest otherwise
    nearest = "nearest"  # round to nearest, ties to even: the plain cast
    dithered = "dithered"  # stochastic rounding with a random threshold fixed per weight (bfloat16 only)


class WeightsConfig(Model):
    """How versions are published. The learner keeps float32 master weights and optimiser state whatever the
    published dtype, and computes its forward on the masters rounded to the published dtype: the policy it
    trains is the one workers sample, and every update that changes a published weight reaches them."""

    dtype: WeightDtype = Field(WeightDtype.auto, description="dtype of the published weights; `auto` is the base "
                               "model's own (bfloat16 for most released models, float32 for `echo2:tiny`).")
    rounding: Rounding = Field(Rounding.auto, description="How masters become published weights. `nearest`: "
                               "the plain cast; a weight moves once its master has moved half a bf16 step (at RL "
                               "learning rates, tens of steps: SmolLM2's held-out accuracy stayed flat for 20 "
                               "steps). `dithered` (bfloat16 versions): the master plus a random fraction of a "
                               "step fixed per weight, truncated; a weight moves once its master passes its own "
                               "threshold, so on average the published weights move as far as the masters, and "
                               "still only the weights that crossed change from one version to the next. `auto` "
                               "(the default): dithered for bfloat16 versions in a single-process learner, nearest "
                               "otherwise (FSDP casts to nearest as it gathers). Measured in docs/BENCHMARKS.md.")
    delta: bool = Field(True, description="Publish each version after the first also as a delta against the one "
                        "before it: workers holding that one fetch only what changed.")
    keyframe_every: int = Field(10, ge=1, le=10_000, description="Every K-th publication (and the first and the "
                                "final one) is also published in full, for workers that hold no recent version.")


LoraTarget = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.]+$")]


class LoraConfig(Model):
    """Train a LoRA adapter (peft) instead of every weight. The job's first version is the base model;
    later ones carry only the adapter (in full: it is small, and all of it changes every step); the final
    one is the merged model with the adapter beside it, in `adapter/`."""

    rank: int = Field(16, ge=1, le=256, description="r: the adapter's rank.")
    alpha: float = Field(32.0, gt=0, le=4096, description="lora_alpha: the update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[LoraTarget] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1, max_length=32,
        description="Names of the linear layers that get an adapter (the attention projections by default).")


class LearnerResources(Model):
    gpus: int = Field(0, ge=0, le=64, description="GPUs on the reserved learner cluster (0 = CPU). More than 1 "
                      "runs the learner as torchrun with FSDP, one process per GPU (CPU processes without CUDA), "
                      "LoRA or full fine-tuning. The learner starts only where this many slots are free on one "
                      "learner host (a slot is a GPU), each GPU at least the job's estimated memory need; a job "
                      "that no registered learner host could hold is refused at submission (422, with the "
                      "numbers).")
    device: Device = Device.auto
    price_per_hour: Price | None = Field(
        None, description="Reserved learner price in $/h; the platform's applies when omitted, and a user may not "
                          "name a lower one (422)."
    )
    activation_checkpointing: bool = Field(False, description="Recompute activations in the backward pass "
                                           "instead of keeping them: less memory, about a third more compute.")


class WorkerNeeds(Model):
    """What a rollout worker must offer to be activated for the job; the scheduler never activates one
    that does not (and `echo2 jobs explain` says so)."""

    memory_gb: float | None = Field(None, gt=0, le=4096, description="GiB the worker must generate in (its VRAM; "
                                    "a CPU worker's RAM). Default: derived from the model's first version — its "
                                    "weights in the published dtype plus the KV cache of one group at full length, "
                                    "with headroom.")
    backends: list[Backend] = Field(default_factory=list, max_length=4, description="Generation backends accepted "
                                    "(empty: any).")
    max_usd_per_group: float | None = Field(None, gt=0, le=1000, description="The most a worker may cost the job a "
                                            "group at its own rate: its price per hour / 3600 over its groups per "
                                            "second (measured, or its claim while on trial). The scheduler activates "
                                            "no worker that costs more, even when the job is short of workers (it "
                                            "then takes every qualifying one). A worker is paid its time while it "
                                            "delivers at ECHO2_PAY_RATE_FRACTION of its rate or better, so a group "
                                            "may cost up to 1 / that fraction of the cap. Default: no cap.")


class TrackerKind(StrEnum):
    wandb = "wandb"
    mlflow = "mlflow"


TrackerText = Annotated[str, StringConstraints(min_length=1, max_length=256), NoNul]


class TrackingConfig(Model):
    """Stream the job's metrics to an experiment tracker, from the learner host: every step's training metrics
    (reward, loss, KL, clipping, tokens, groups, staleness, learner utilisation) and cost, and every held-out
    evaluation. Its credentials stay on the learner host (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN...), never in a
    spec: `uri` and `dir` are refused (422) inside Echo2's own data or database, and in production unless the
    operator allows them (ECHO2_TRACKING_TARGETS). A resumed job goes on in the same run. Needs
    `echo2-server[trackers]` on the learner host."""

    kind: TrackerKind = Field(description="`wandb` (Weights & Biases) or `mlflow`.")
    project: TrackerText = Field(description="The W&B project, or the MLflow experiment.")
    run_name: TrackerText | None = Field(None, description="The run's name (default: the job's name and id).")
    uri: TrackerText | None = Field(None, description="MLflow: the tracking URI as the learner host reaches it "
                                    "(http://..., sqlite:///path, or file:///path with MLFLOW_ALLOW_FILE_STORE=true "
                                    "there); W&B: the server's base URL (default: the host's own setting).")
    mode: Literal["online", "offline"] = Field("online", description="W&B: `offline` writes the run to `dir` on the "
                                               "learner host only (`wandb sync` uploads it later).")
    dir: TrackerText | None = Field(None, description="W&B: the folder its run directory goes in, on the learner "
                                    "host (default: the learner's work folder).")
    entity: TrackerText | None = Field(None, description="W&B: the team or user the run belongs to.")
    tags: list[Annotated[str, StringConstraints(min_length=1, max_length=64), NoNul]] = Field(
        default_factory=list, max_length=16)


class PromptIn(Model):
    """One inline prompt item; keys depend on the task (e.g. `question`/`answer` for gsm8k)."""

    item: Item = Field(max_length=16)


class JobSpec(Model):
    """Everything needed to run a GRPO job. Server-side defaults fill what is omitted."""

    name: Name
    base_model: ModelRef = Field(
        description="HF hub id, a local path on the learner host (outside Echo2's own data directory, where "
                    "other jobs' files are), or a built-in: `echo2:tiny`, `echo2:smollm2`. Refused at submission "
                    "(422) when the learner host could not load it: an unknown built-in, a path that is no model "
                    "folder, a Hub id it cannot reach and has not in its Hugging Face cache."
    )
    task: TaskSpec
    dataset_id: Id | None = Field(None, description="Uploaded dataset to draw prompts from.")
    prompts: list[PromptIn] | None = Field(None, max_length=10_000, description="Inline prompt items.")
    num_prompts: int | None = Field(
        None, ge=1, le=200_000, description="Prompts to generate for synthetic tasks (default: enough for all steps)."
    )
    reuse_prompts: bool = Field(False, description="When the training prompts are fewer than one step's "
                                "grpo.prompts_per_step, repeat them (each copy a group of its own) to fill a step. "
                                "Off: such a job is refused (422), since it would wait for the missing groups "
                                "forever.")
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    staleness: int = Field(2, ge=0, le=64, description="S: a rollout of version x trains at step t only if t-x <= S.")
    publish_period: int = Field(1, ge=1, le=64, description="κ: publish a weight version every κ steps.")
    partial_rollouts: bool = Field(False, description="Workers interrupt a generation when a newer version arrives, "
                                   "load it and continue from the tokens they have; every token carries the version "
                                   "that produced it, the oldest bounds the group's staleness, and each token's "
                                   "importance ratio is taken against its own behaviour logprob. Single-turn "
                                   "tasks only.")
    max_steps: int = Field(100, ge=1, le=100_000)
    budget_usd: float | None = Field(None, ge=0, le=1_000_000, description="Pause the job when spent; raise it "
                                     "(PATCH /v1/jobs/{id}) to resume.")
    learner: LearnerResources = Field(default_factory=LearnerResources)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    lora: LoraConfig | None = Field(None, description="Train a LoRA adapter instead of the full model.")
    workers: WorkerNeeds = Field(default_factory=WorkerNeeds)
    checkpoint_every: int = Field(10, ge=1, le=100_000, description="Learner checkpoint period in steps.")
    tracking: TrackingConfig | None = Field(None, description="Stream the job's metrics to Weights & Biases or "
                                            "MLflow from the learner host.")
    trace_logprobs: bool = Field(True, description="The learner records its own logprob of every token it trains "
                                 "on, beside the worker's, for rollout traces (GET /v1/jobs/{id}/rollouts/{rollout}): "
                                 "one forward pass without gradients per step, about a third of a step's compute "
                                 "(single-process learners).")
    reward_failures_to_pause: int = Field(
        16, ge=1, le=100_000, description="Pause the job (paused_for `reward`, the reason in status_reason) once this "
        "many claimed groups in a row could not be scored by its task (an http_reward endpoint down, an exception, a "
        "timeout). Such a group is never trained; its worker is paid (the platform's fault) and its prompt returns to "
        "the pool. A step with no unscored group starts the count again; POST /v1/jobs/{id}/resume resumes the job.")
    seed: int = Field(0, ge=0, le=2**31 - 1)
    priority: int = Field(0, ge=-100, le=100, description="Higher first when jobs compete for learner slots and "
                          "workers. Above 0 is an admin's to give (403 for a user): a user's job may have 0 or less, "
                          "to let the user's other jobs go first.")

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        if self.publish_period > max_publish_period(self.staleness):
            raise ValueError(
                f"publish_period (κ={self.publish_period}) must be <= staleness + 1 ({self.staleness + 1}): "
                "otherwise every rollout would be too stale to train"
            )
        if self.dataset_id is not None and self.prompts is not None:
            raise ValueError("give either dataset_id or inline prompts, not both")
        if self.weights.rounding is Rounding.dithered and self.learner.gpus > 1:
            raise ValueError("weights.rounding `dithered` needs a single-process learner (with FSDP the masters are "
                             "cast to the published dtype as they are gathered, to nearest): set learner.gpus to "
                             "0 or 1, or rounding to `nearest`")
        dtype = self.weights.dtype
        if self.weights.rounding is Rounding.dithered and dtype not in (WeightDtype.auto, WeightDtype.bfloat16):
            raise ValueError(f"weights.rounding `dithered` applies to bfloat16 versions, not {dtype.value}")
        self.grpo.check_correction()
        return self

    def admissible(self, step: int, version: int) -> bool:
        """The staleness rule, stated once: a rollout of version x trains at step t only if 0 <= t - x <= S."""
        return 0 <= step - version <= self.staleness

    def oldest_admissible(self, step: int) -> int:
        """The oldest version whose rollouts may still train at step t."""
        return max(0, step - self.staleness)


def max_publish_period(staleness: int) -> int:
    """The κ rule: κ <= S + 1. Rollouts of the version published at step x train until step x + S, so with
    κ = S + 1 they cover exactly the steps until the next version; a larger κ leaves steps with no
    admissible version at all."""
    return staleness + 1


def slack_steps(staleness: int, publish_period: int) -> int:
    """S - κ + 1: how many learner steps of dissemination plus generation latency a worker's rollouts
    can absorb and still be admissible when the learner gets to them. 0 (S = 0, or κ = S + 1) means the
    learner must wait for rollouts of the newest version at the start of each publication window."""
    return staleness - publish_period + 1


class JobCost(ReadModel):
    learner_usd: float = 0.0
    workers_usd: float = 0.0
    total_usd: float = 0.0


class JobUpdate(Model):
    """What may change while a job lives. Raising the budget of a job paused by its budget resumes it."""

    budget_usd: float | None = Field(description="The new budget in $ (null: none). A job paused because its "
                                     "budget ran out is queued again when this is above what it has spent.",
                                     ge=0, le=1_000_000)


class JobRead(ReadModel):
    id: str
    name: str
    owner_id: str
    kind: JobKind = Field(JobKind.grpo, description="`grpo`: trained by its own learner on its task. "
                          "`tinker_fleet`: the worker fleet sampling for a Tinker model (no learner, no task; "
                          "GET /v1/jobs?tinker=true lists them).")
    status: JobStatus
    status_reason: str | None = Field(None, description="Why it is queued (its place in line and what it waits "
                                      "for), paused, or how it ended.")
    queue_position: int | None = Field(None, description="A queued job's place among those waiting for a learner "
                                       "(1 = next).")
    paused_for: str | None = Field(None, description="A paused job's cause: `budget` (raise it to resume), "
                                   "`quota` (the owner's daily spending; it resumes by itself) or `reward` (its task "
                                   "could not score its groups: fix the task's endpoint, then POST "
                                   "/v1/jobs/{id}/resume).")
    memory_need_gb: float | None = Field(None, description="GiB a worker needs to be activated for the job: "
                                         "`workers.memory_gb`, or derived from its first version.")
    learner_memory_gib: float | None = Field(None, description="GiB each of its learner's GPUs needs, estimated "
                                             "at submission from the model's config (POST /v1/jobs:estimate "
                                             "gives the parts); its learner starts only on GPUs that large. "
                                             "Null when the model's config was not at hand.")
    spec: JobSpec
    step: int = Field(description="Learner steps completed (the current policy version counter t).")
    version: int | None = Field(description="Latest published weight version, if any.")
    final_version: int | None = Field(None, description="The version holding the final checkpoint, once finished.")
    num_prompts: int
    reward_mean: float | None = None
    cost: JobCost = Field(default_factory=JobCost)
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None


class PromptRead(ReadModel):
    id: int
    index: int
    text: str
    context: list[dict[str, str]] | None = Field(None, description="A chat item's turns before `text`.")
    reference: str | None
    state: PromptState
    epoch: int
    attempts: int


class TaskInfo(ReadModel):
    name: str
    description: str
    needs_dataset: bool
    params_schema: dict[str, Any]


class DecisionRead(ReadModel):
    """One line of an activation decision about one worker and this job, e.g. "activated w17: cheapest per
    rollout that still meets freshness", "idle w3: qualifies but not needed", "skipped w9: VRAM 8 GiB <
    need 11.5 GiB" or "skipped w4: serves job J (one job at a time)"; a user reads another tenant's job there, and
    in the trigger, as "another job". Stored as changes: re-solves that decide
    the same action for the worker again count on this line (`repeats`, `decided_at`) and give it their
    wording, trigger and inputs."""

    worker_id: str
    action: str
    line: str
    trigger: str
    created_at: datetime = Field(description="When the scheduler first decided this action for the worker.")
    repeats: int = Field(1, description="How many decisions in a row this line stands for.")
    decided_at: datetime | None = Field(None, description="The newest of them (its wording is this line's).")
