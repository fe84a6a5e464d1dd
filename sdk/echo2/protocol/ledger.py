"""Money: the cost ledger's entries as providers and job owners read them, and a job's cost estimated
before it runs."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import Field

from .common import ReadModel
from .jobs import JobCost


class LedgerKind(StrEnum):
    worker = "worker"  # a worker paid for the rollouts it delivered
    learner = "learner"  # the job's reserved learner, for the time it was alive
    clawback = "clawback"  # a worker's payments taken back (negative) once it was caught forging
    forfeit = "forfeit"  # and its groups not paid yet, settled with nothing ($0.00, naming them)


class LedgerEntryRead(ReadModel):
    """One payment: who was paid, on which job, at which of its steps, how much and what for."""

    id: int
    created_at: datetime = Field(description="When the scheduler made the payment.")
    kind: LedgerKind
    job_id: str
    worker_id: str | None = Field(description="The worker paid (worker entries only).")
    provider_id: str | None
    step: int | None = Field(description="The job's step when the entry was made.")
    groups: int = Field(description="Rollout groups paid for (worker entries); negative on a clawback, the "
                        "groups whose pay it takes back.")
    seconds: float = Field(description="Billed time: a worker's active time its rollouts bought, or the "
                           "learner's reserved time; negative on a clawback.")
    amount_usd: float
    memo: str | None = Field(description="What it pays for, in words.")


class LedgerTotal(ReadModel):
    """The entries of one worker, one job or one kind, summed."""

    key: str = Field(description="The worker id, job id or kind the entries are grouped by.")
    entries: int
    groups: int
    seconds: float
    amount_usd: float


class ProviderStatement(ReadModel):
    """A provider's earnings between `since` and `until`: every entry (one page of them) and totals over all."""

    provider_id: str
    since: datetime | None
    until: datetime | None
    entries: list[LedgerEntryRead]
    total_entries: int = Field(description="Entries in the period; `entries` is one page of them.")
    next_offset: int | None = Field(None, description="Pass as `offset` for the next page of entries.")
    by_worker: list[LedgerTotal] = Field(description="Totals per worker over the whole period.")
    by_job: list[LedgerTotal] = Field(description="Totals per job over the whole period.")
    total_usd: float = Field(description="Paid in the period: the sum of every entry in it.")
    earnings_usd: float = Field(description="The provider's earnings since it signed up (all periods).")


class JobLedger(ReadModel):
    """What a job cost, entry by entry; the totals by kind sum to the job's cost."""

    job_id: str
    entries: list[LedgerEntryRead]
    total_entries: int
    next_offset: int | None = None
    by_kind: list[LedgerTotal] = Field(description="Totals per kind (learner, worker) over every entry.")
    total_usd: float
    cost: JobCost = Field(description="The job's cost as JobRead reports it: the same sums.")


class EstimateWorker(ReadModel):
    """A worker the capacity rule would activate for the job now, and the rate it is counted at."""

    worker_id: str
    name: str
    price_per_hour: float
    mu: float = Field(description="Rollout groups per second it is counted at.")
    mu_source: str = Field(description="Where μ came from: measured on earlier jobs, or its claim.")
    fresh: bool = Field(description="Meets the freshness rule (T_bcast + T_gen within the slack).")


class LearnerMemory(ReadModel):
    """What each of a job's learner GPUs must hold, estimated from its model's config before it runs (weights
    and optimiser state sharded over `gpus` under FSDP; the reference model whole on each). An estimate: a
    few GiB either way (allocator, kernels' workspaces); compared with the learner hosts' GPUs at submission."""

    per_gpu_gib: float = Field(description="GiB each GPU needs: the sum of the parts below.")
    gpus: int = Field(description="GPUs it is spread over: max(1, learner.gpus).")
    params: int = Field(description="Parameters of the model.")
    trainable: int = Field(description="Parameters trained: all of them, or the LoRA adapter's.")
    weights_gib: float = Field(description="float32 weights (the master copy; with LoRA, the frozen base and "
                               "the adapter), this GPU's share.")
    gradients_gib: float = Field(description="float32 gradients of the trained parameters, this GPU's share.")
    optimizer_gib: float = Field(description="AdamW's two float32 moments of the trained parameters, this "
                                 "GPU's share.")
    reference_gib: float = Field(description="The float32 reference model of the KL penalty (grpo.kl_coef > 0), "
                                 "whole on every GPU; 0 without.")
    gathered_gib: float = Field(description="FSDP's gathered full layers during a pass (more than one GPU).")
    activations_gib: float = Field(description="Activations kept for the backward pass and the completion "
                                   "logits, at grpo.micro_batch_tokens shared over the GPUs (less with "
                                   "learner.activation_checkpointing).")
    runtime_gib: float = Field(description="CUDA context and kernels.")
    source: str = Field(description="Where the model's sizes came from.")
    largest_gpu_gib: float | None = Field(None, description="The largest GPU of the registered learner hosts with "
                                          "at least `gpus` GPUs; null when none is registered.")
    fits: bool | None = Field(None, description="A registered learner host can hold it; null when that is not "
                              "known (no learner host with GPUs registered) or it does not compute on a GPU.")


class JobEstimate(ReadModel):
    """A job's cost estimated before it runs: learner time from earlier similar jobs, the workers the
    capacity rule would activate now, and the assumptions in words."""

    t_train_s: float = Field(description="Learner seconds of training per step (T_train).")
    t_train_source: str
    step_overhead_s: float = Field(description="Learner seconds per step beyond training (publishing, "
                                   "reporting, evaluating), measured on earlier similar jobs; 0 without any.")
    startup_s: float = Field(description="Learner seconds outside its steps (loading, first version, final "
                             "evaluation), measured on earlier similar jobs; 0 without any.")
    rollouts_per_step: int = Field(description="R: rollout groups the learner trains per step.")
    required_throughput: float = Field(description="(1 + h) · R / T_train, groups per second.")
    throughput: float = Field(description="Σμ of the workers below, groups per second.")
    workers: list[EstimateWorker]
    feasible: bool = Field(description="The workers meet the capacity rule.")
    step_s: float = Field(description="Expected wall seconds per step: max(T_train + overhead, R / Σμ).")
    wall_s: float = Field(description="startup + max_steps · step_s.")
    learner_price_per_hour: float
    workers_price_per_hour: float
    learner_usd: float
    workers_usd: float
    cost_usd: float
    assumptions: list[str] = Field(description="What the figures assume, in words.")
    learner_memory: LearnerMemory | None = Field(None, description="What each learner GPU must hold; null when "
                                                 "the model's config is not at hand on the control plane.")
