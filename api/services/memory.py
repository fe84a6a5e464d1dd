"""What each of a job's learner GPUs must hold, estimated at submission from its model's config, and the
refusal of a job that no registered learner host can hold.

Per GPU, with P the model's parameters, T those trained (P, or the LoRA adapter's), N = max(1, gpus):

    weights     4·P/N  float32 master copy (LoRA: the frozen base, sharded too, plus the adapter)
    gradients   4·T/N
    optimiser   8·T/N  AdamW's two float32 moments
    reference   4·P    the KL penalty's reference model (grpo.kl_coef > 0), whole on every rank
    gathered    4·(root + 2·layer)  FSDP's full copy of the root and of two decoder layers (N > 1)
    activations t·L·a per token, t = micro_batch_tokens / N (ranks share a micro-batch's rows); a =
                24·h + w·(5·h + 3·kv + 4·I) bytes per token and layer (float32 residual stream and norms,
                the rest at w = 2 bytes under CUDA bf16 autocast); with activation checkpointing only
                each layer's input (4·h) is kept, plus one layer recomputed. Plus the completion logits:
                t·c·V·(w + 8), c = max_new_tokens / (512 + max_new_tokens), twice with a reference model.
    runtime     1 GiB  CUDA context and kernels

Checked against issue 28's measurement: SmolLM2-1.7B full fine-tuning at 8,192-token micro-batches peaked
at 57 GiB on an H100; this gives 55.4 GiB. Qwen2.5-7B full fine-tuning needs 113.5 GiB of states alone
(16 bytes a parameter), more than an 80 GB card.

The model's sizes come from the files at hand on the control plane: a built-in's known config, a local
folder (when `model_check` is "host": the control plane sees the learner hosts' disks) or the Hugging Face
cache; the parameter count from the safetensors headers beside the config when present (exact), else from
the config's dimensions. A model whose config is not at hand is not estimated, and not refused.

The refusal: a job that computes on GPUs (learner.gpus >= 1, or device cuda) is refused (422, with the
numbers and what to change) when learner hosts with GPUs are registered (seen within a day: a host that
restarts still counts) and none has max(1, gpus) GPUs each holding its need. With no learner host with GPUs
registered, the job is accepted: the platform may be starting, and a host that can hold it may join; until
one does, it waits in line saying so (scheduler/placement.py).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from echo2.modelinfo import PROMPT_TOKENS, folder_reader
from echo2.models import TINY_CONFIG, TINY_VOCAB_SIZE
from echo2.protocol import JobSpec, LearnerMemory, LoraConfig
from sqlalchemy import select
from sqlalchemy.orm import Session

from ..errors import ApiError
from ..models import LearnerHost, utcnow
from ..settings import Settings

GIB = 2**30
RUNTIME_GIB = 1.0
# echo2:smollm2 is converted from a GGUF on the learner host; its config (SmolLM2-135M-Instruct) is fixed.
SMOLLM2_CONFIG = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                  "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                  "max_position_embeddings": 8192, "tie_word_embeddings": True}
BUILTIN_CONFIGS = {"echo2:tiny": {**TINY_CONFIG, "model_type": "qwen2", "vocab_size": TINY_VOCAB_SIZE},
                   "echo2:smollm2": SMOLLM2_CONFIG}
MAX_HEADER = 100 * 2**20  # a safetensors header longer than this is not a header
REGISTERED_WITHIN = timedelta(days=1)  # a learner host silent longer no longer counts as one the platform has


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's sizes, as the memory estimate needs them."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    kv_width: int  # num_key_value_heads · head_dim
    vocab: int
    tied: bool
    source: str

    @property
    def root(self) -> int:
        """Parameters outside the decoder layers: embeddings, the LM head when untied, the final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def layer(self) -> int:
        return max(0, self.params - self.root) // max(1, self.layers)


def shape_of(ref: str, settings: Settings) -> Shape | None:
    """The model's sizes from the files the control plane has at hand (module docstring), or None."""
    found = config_of(ref, settings)
    return None if found is None else _shape(*found)


def config_of(ref: str, settings: Settings) -> tuple[dict[str, Any], Path | None, str] | None:
    """The model's config.json where the control plane has it at hand (module docstring), the folder it is in
    (None for a built-in) and where it was read, or None."""
    if ref in BUILTIN_CONFIGS:
        return BUILTIN_CONFIGS[ref], None, f"the built-in {ref}'s config"
    folder = _folder(ref, settings)
    if folder is None:
        return None
    return folder_reader(folder)("config.json"), folder, f"{folder / 'config.json'}"


def _folder(ref: str, settings: Settings) -> Path | None:
    local = Path(ref).expanduser()
    if ref.startswith(("/", "~", ".")) or local.exists():
        ok = settings.model_check == "host" and (local / "config.json").is_file()
        return local if ok else None
    try:
        import huggingface_hub

        cached = huggingface_hub.try_to_load_from_cache(ref, "config.json", cache_dir=settings.hf_hub_cache)
    except Exception:  # a malformed id: model_error has said so already
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def _shape(config: dict[str, Any], folder: Path | None, source: str) -> Shape | None:
    config = config.get("text_config") or config
    ints = [config.get(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                    "vocab_size")]
    if not all(isinstance(v, int) and v > 0 for v in ints):
        return None
    hidden, inter, layers, heads, vocab = ints
    head_dim = config.get("head_dim") or hidden // heads
    kv_width = (config.get("num_key_value_heads") or heads) * head_dim
    tied = bool(config.get("tie_word_embeddings", True))
    counted = _safetensors_params(folder) if folder is not None else None
    params = counted or _config_params(config, hidden, inter, layers, heads * head_dim, kv_width, vocab, tied)
    how = "parameters counted in its safetensors files" if counted else "parameters from its dimensions"
    return Shape(params, layers, hidden, inter, kv_width, vocab, tied, f"{source} ({how})")


def _config_params(config: dict[str, Any], hidden: int, inter: int, layers: int, q_width: int, kv_width: int,
                   vocab: int, tied: bool) -> int:
    """A Llama-style decoder: attention, a gated MLP, two norms a layer; biases on q/k/v where it has them."""
    bias = config.get("attention_bias", config.get("model_type") == "qwen2")
    attention = hidden * (q_width + 2 * kv_width) + q_width * hidden + (q_width + 2 * kv_width if bias else 0)
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    return layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden


def _safetensors_params(folder: Path) -> int | None:
    """Elements of every tensor in the folder's safetensors files (their headers only), or None."""
    total = 0
    files = sorted(folder.glob("*.safetensors"))
    for path in files:
        try:
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if size > MAX_HEADER:
                    return None
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            return None
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total or None


def need(shape: Shape, spec: JobSpec) -> LearnerMemory:
    """Each learner GPU's need, part by part (module docstring)."""
    n = max(1, spec.learner.gpus)
    trainable = lora_params(shape, spec.lora) if spec.lora is not None else shape.params
    frozen = shape.params if spec.lora is not None else 0
    width = 4 if spec.learner.device.value == "cpu" else 2
    parts = {
        "weights_gib": 4 * (frozen + trainable) / n,
        "gradients_gib": 4 * trainable / n,
        "optimizer_gib": 8 * trainable / n,
        "reference_gib": 4 * shape.params if spec.grpo.kl_coef > 0 else 0,
        "gathered_gib": 4 * (shape.root + 2 * shape.layer) if n > 1 else 0,
        "activations_gib": _activations(shape, spec, n, width),
    }
    parts = {k: round(v / GIB, 2) for k, v in parts.items()}
    total = round(sum(parts.values()) + RUNTIME_GIB, 2)
    return LearnerMemory(per_gpu_gib=total, gpus=n, params=shape.params, trainable=trainable,
                         runtime_gib=RUNTIME_GIB, source=shape.source, **parts)


def _activations(shape: Shape, spec: JobSpec, n: int, width: int) -> float:
    tokens = math.ceil(spec.grpo.micro_batch_tokens / n)
    h = shape.hidden
    per_layer = 24 * h + width * (5 * h + 3 * shape.kv_width + 4 * shape.intermediate)
    kept = shape.layers * (4 * h) + per_layer if spec.learner.activation_checkpointing else shape.layers * per_layer
    completion = spec.grpo.max_new_tokens / (PROMPT_TOKENS + spec.grpo.max_new_tokens)
    logits = completion * shape.vocab * (width + 8) * (2 if spec.grpo.kl_coef > 0 else 1)
    return tokens * (kept + logits)


LORA_SHAPES = {"q_proj": ("h", "q"), "k_proj": ("h", "kv"), "v_proj": ("h", "kv"), "o_proj": ("q", "h"),
               "gate_proj": ("h", "i"), "up_proj": ("h", "i"), "down_proj": ("i", "h")}


def lora_params(shape: Shape, lora: LoraConfig) -> int:
    """r·(in + out) for each targeted projection of each layer (other target names are not counted)."""
    width = {"h": shape.hidden, "q": shape.hidden, "kv": shape.kv_width, "i": shape.intermediate}
    per_layer = sum(lora.rank * (width[a] + width[b]) for name, (a, b) in LORA_SHAPES.items()
                    if name in lora.target_modules)
    return shape.layers * per_layer


# ---------------------------------------------------------------- against the learner hosts


def computes_on_gpu(spec: JobSpec) -> bool:
    """It will run on GPUs: it asked for some, or for device cuda."""
    device = spec.learner.device.value
    return device == "cuda" or (spec.learner.gpus >= 1 and device != "cpu")


def judge(db: Session, spec: JobSpec, shape: Shape | None) -> tuple[LearnerMemory | None, str | None]:
    """(each learner GPU's need, with the registered hosts' answer when there is one; why no registered learner
    host can hold the job, or None)."""
    memory = need(shape, spec) if shape is not None else None
    hosts = registered_gpu_hosts(db) if computes_on_gpu(spec) else []
    if not hosts:
        return memory, None
    n = max(1, spec.learner.gpus)
    most = max(len(h.gpus) for h in hosts)
    if most < n:
        return memory, (f"learner.gpus {spec.learner.gpus}: no registered learner host has {n} GPUs (the most on "
                        f"one host: {most}); ask for at most {most}")
    if memory is None:
        return None, None
    largest = _capacity(hosts, n)
    memory = memory.model_copy(update={"largest_gpu_gib": largest, "fits": memory.per_gpu_gib <= largest})
    if memory.fits:
        return memory, None
    assert shape is not None
    remedies = _remedies(shape, spec, hosts)
    what = f"To change: {'; '.join(remedies)}" if remedies else "It needs a learner host with larger GPUs."
    return memory, f"{_too_big(memory, spec, largest)}. {what}"


def registered_gpu_hosts(db: Session) -> list[LearnerHost]:
    """Learner hosts with GPUs seen within REGISTERED_WITHIN, live or not (one restarting still counts)."""
    hosts = db.scalars(select(LearnerHost).where(LearnerHost.seen_at >= utcnow() - REGISTERED_WITHIN))
    return [h for h in hosts if h.gpus]


def _capacity(hosts: list[LearnerHost], n: int) -> float:
    """GiB that n GPUs of one registered host each hold at best (0 when no host has n)."""
    return max((float(sorted((g["memory_gib"] for g in h.gpus), reverse=True)[n - 1])
                for h in hosts if len(h.gpus) >= n), default=0.0)


def _too_big(m: LearnerMemory, spec: JobSpec, largest: float) -> str:
    what = "LoRA" if spec.lora is not None else "full fine-tuning"
    parts = (f"weights {m.weights_gib:g} + gradients {m.gradients_gib:g} + AdamW {m.optimizer_gib:g} + reference "
             f"{m.reference_gib:g} + FSDP gathers {m.gathered_gib:g} + activations {m.activations_gib:g} + runtime "
             f"{m.runtime_gib:g}")
    return (f"this job needs about {m.per_gpu_gib:g} GiB on each of its {m.gpus} learner GPU(s) ({what} of "
            f"{m.params / 1e9:.2f}B parameters: {parts} GiB), and the largest registered learner host's GPUs hold "
            f"{largest:g} GiB")


def _remedies(shape: Shape, spec: JobSpec, hosts: list[LearnerHost]) -> list[str]:
    """What the user could change, each with the need it gives and whether a registered host holds it; when
    no single change is enough, also the fewest changes together that are."""
    options = _options(shape, spec, hosts)

    def fits(changed: JobSpec) -> tuple[float, bool]:
        m = need(shape, changed)
        return m.per_gpu_gib, m.per_gpu_gib <= _capacity(hosts, m.gpus)

    out = []
    for words, change in options:
        gib, ok = fits(change(spec))
        out.append(f"{words}: about {gib:g} GiB a GPU ({'fits' if ok else 'still too big'})")
    if not any(line.endswith("(fits)") for line in out):
        for size in range(2, len(options) + 1):
            for combo in itertools.combinations(options, size):
                changed = functools.reduce(lambda acc, option: option[1](acc), combo, spec)
                gib, ok = fits(changed)
                if ok:
                    return [*out, f"together, {' and '.join(w for w, _ in combo)}: about {gib:g} GiB a GPU (fits)"]
    return out


Change = Callable[[JobSpec], JobSpec]


def _options(shape: Shape, spec: JobSpec, hosts: list[LearnerHost]) -> list[tuple[str, Change]]:
    """The single changes worth naming for this job: LoRA, more GPUs (the fewest that hold it, else all of
    the widest host's), activation checkpointing, smaller micro-batches, no KL reference."""
    def learner(**update: Any) -> Change:
        return lambda s: s.model_copy(update={"learner": s.learner.model_copy(update=update)})

    def grpo(**update: Any) -> Change:
        return lambda s: s.model_copy(update={"grpo": s.grpo.model_copy(update=update)})

    out: list[tuple[str, Change]] = []
    if spec.lora is None:
        out.append(("train a LoRA adapter (lora: {})", lambda s: s.model_copy(update={"lora": LoraConfig()})))
    most = max(len(h.gpus) for h in hosts)
    wider = [g for g in range(max(2, spec.learner.gpus + 1), most + 1)
             if need(shape, learner(gpus=g)(spec)).per_gpu_gib <= _capacity(hosts, g)]
    if most > max(1, spec.learner.gpus):
        gpus = wider[0] if wider else most
        out.append((f"shard it over more GPUs (learner.gpus: {gpus})", learner(gpus=gpus)))
    if not spec.learner.activation_checkpointing:
        out.append(("learner.activation_checkpointing: true", learner(activation_checkpointing=True)))
    smaller = max(64, spec.grpo.micro_batch_tokens // 4)
    if smaller < spec.grpo.micro_batch_tokens:
        out.append((f"grpo.micro_batch_tokens: {smaller}", grpo(micro_batch_tokens=smaller)))
    if spec.grpo.kl_coef > 0:
        out.append(("grpo.kl_coef: 0 (no reference model)", grpo(kl_coef=0.0)))
    return out


def check(db: Session, spec: JobSpec, settings: Settings) -> LearnerMemory | None:
    """Each learner GPU's need (None when the model's config is not at hand), or the 422 that refuses a job
    no registered learner host can hold, with the numbers and what to change."""
    memory, refusal = judge(db, spec, shape_of(spec.base_model, settings))
    if refusal is not None:
        raise ApiError(422, refusal, field="learner")
    return memory
