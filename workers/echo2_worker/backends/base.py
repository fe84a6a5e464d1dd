"""The generation-backend interface the worker's poll loop talks to.

Sampling: every backend draws with echo2.sampler, the replayable sampler: token i of a sample is a pure
function of the logits, the request's settings, the sample's seed and i, so the learner's auditor can
replay it under the version the worker claims.

Behaviour logprob (both backends, and the learner's recomputation, use this exact definition):
    logprob(token_t) = log_softmax(logits_t / temperature)[token_t]
computed on the full vocabulary BEFORE top-k/top-p truncation. Truncation only changes which tokens can
be drawn, never the reported logprob, so the learner can recompute it from the weights alone.

This module must stay free of torch / vllm imports: `echo2-worker --help` imports it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from echo2.modelinfo import eos_token_ids, folder_reader

FinishReason = Literal["stop", "length"]


class BackendError(RuntimeError):
    """A backend could not load a model folder or generate; the message says why."""


@dataclass(frozen=True)
class GenRequest:
    """One prompt to complete `n` times (a GRPO group), one seed per sample."""

    prompt_token_ids: list[int]
    n: int
    seeds: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k; applied before top-p, which then keeps its share of the top-k mass (as vLLM)
    # Generation ends (finish_reason "stop") at the model's eos ids (see model_eos_token_ids) or at
    # any of these extra ids; the stopping token is kept in token_ids (and has a logprob).
    stop_token_ids: list[int] = field(default_factory=list)
    # False: stop only at stop_token_ids, not at the model's eos (a Tinker request that names its stop tokens).
    stop_at_eos: bool = True
    # Where the new tokens start in the sample's completion: a partial rollout's next segment or an episode's
    # next turn continues from the tokens it has. The sampler draws token i of a sample from (seed, position i).
    start_position: int = 0

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if len(self.seeds) != self.n:
            raise ValueError(f"need one seed per sample: n={self.n} but {len(self.seeds)} seeds")
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (greedy is not a sampling policy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.start_position < 0:
            raise ValueError(f"start_position must be >= 0, got {self.start_position}")


@dataclass(frozen=True)
class GenSample:
    """One completion: its tokens, one behaviour logprob per token, and why it ended.

    `text` is tokenizer.decode(token_ids, skip_special_tokens=True): a stop token is in token_ids
    (and in text unless it is a special token such as eos).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.logprobs)} logprobs")


class GenerationBackend(ABC):
    """Loads an HF model folder (safetensors only), optionally with a LoRA adapter folder (peft's
    adapter_config.json + adapter_model.safetensors) applied to it, and samples groups of completions."""

    name: str = "base"
    precision: str = "float32"  # the dtype logits are computed in once loaded (echo2.protocol.Precision)

    @abstractmethod
    def load(self, model_dir: Path, adapter_dir: Path | None = None, *, lora_rank: int | None = None) -> None:
        """Load weights, config and tokenizer from an HF folder, and the adapter when given. `lora_rank`:
        the job trains an adapter of that rank (its first version, the base, has none yet), so a backend
        that must be built for adapters is built for them now."""

    @abstractmethod
    def reload(self, model_dir: Path, adapter_dir: Path | None = None) -> None:
        """Swap in the weights of a newer version (same architecture) in place: a new model folder, or a
        new adapter on the same base."""

    @abstractmethod
    def generate(self, requests: list[GenRequest]) -> list[list[GenSample]]:
        """Return, per request, its `n` samples in seed order."""

    @abstractmethod
    def close(self) -> None:
        """Free the model and any engine processes. Safe to call twice."""

    def __enter__(self) -> GenerationBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def safetensors_files(model_dir: Path) -> list[Path]:
    """The folder's safetensors weight files; refuses folders that only carry pickled weights."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise BackendError(f"{model_dir} is not an HF model folder (no config.json)")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
        hint = f" (found pickled weights {pickled}; only safetensors are loaded)" if pickled else ""
        raise BackendError(f"{model_dir} has no *.safetensors weights{hint}")
    return files


def adapter_files(adapter_dir: Path) -> tuple[dict[str, object], Path]:
    """An adapter folder's config and weights file; refuses folders that are not one."""
    import json

    config, weights = Path(adapter_dir) / "adapter_config.json", Path(adapter_dir) / "adapter_model.safetensors"
    if not config.is_file() or not weights.is_file():
        raise BackendError(f"{adapter_dir} is not a LoRA adapter folder (adapter_config.json and "
                           "adapter_model.safetensors)")
    try:
        return json.loads(config.read_text()), weights
    except ValueError as exc:
        raise BackendError(f"{config} is not valid JSON: {exc}") from exc


def model_eos_token_ids(model_dir: Path) -> set[int]:
    """The eos ids a folder declares (echo2.modelinfo, the rule the control plane checks samples by)."""
    return eos_token_ids(folder_reader(model_dir))
