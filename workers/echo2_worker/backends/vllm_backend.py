"""vLLM generation backend: an in-process `vllm.LLM` engine (vllm is imported lazily).

Sampling. Every token is drawn by echo2.sampler, the replayable sampler the learner's auditor replays,
through one logits processor, `ReplayableSampler`. vLLM applies it after temperature (it is declared
argmax-invariant, which only means vLLM skips it for greedy requests, and a worker never sends one) and
before top-k/top-p: it draws each row's token from log_softmax(logits / T) with the row's own seed,
position (where the request starts in its sample plus the tokens output so far), top-k and top-p, and
leaves that token the row's only finite entry, holding its behaviour logprob. vLLM's own top-k/top-p are
off (the processor applied them) and its draw from a one-hot row is that token; with
`logprobs_mode="processed_logits"` the value it returns is exactly the behaviour logprob of base.py.
The request's seed, position and truncation travel in SamplingParams.extra_args["echo2"].

Reload. vLLM 0.32 reloads weights in place: Worker.reload_weights(weights_path=...) runs the model
loader's safetensors iterator into the live model (engine, KV cache and compiled graphs are kept).
We reach it with `collective_rpc` through our worker extension (Echo2WorkerExtension: only strings
cross the process boundary, no pickled callables). On CPU the prepacked GEMM weights of a layer
that shares a Parameter (a tied lm_head) are then re-packed (see _refresh_cpu_packed_weights).
Finally the prefix cache is reset: its KV blocks were computed with the old weights. A vLLM
without reload_weights, or a folder with another architecture, gets a new engine instead.

LoRA. With an adapter the engine serves the base (enable_lora, max_lora_rank the smallest size that
fits the adapter's r) and every request names the adapter (a LoRARequest); a newer adapter on the same
base gets a new request id, and the engine stays.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
import time
from pathlib import Path
from typing import Any

from echo2_worker.backends.base import (
    BackendError,
    GenerationBackend,
    GenRequest,
    GenSample,
    adapter_files,
    model_eos_token_ids,
    safetensors_files,
)

log = logging.getLogger(__name__)

LOGITS_PROCESSOR_FQCN = f"{__name__}:ReplayableSampler"
SAMPLER_KEY = "echo2"  # SamplingParams.extra_args[SAMPLER_KEY]: the replayable sampler's settings of a request
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices
WORKER_EXTENSION_FQCN = f"{__name__}.Echo2WorkerExtension"
# config.json fields that must match for an in-place reload to be valid.
_ARCH_FIELDS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


class VLLMBackend(GenerationBackend):
    """Sampling with vLLM; extra keyword arguments go to `vllm.LLM` unchanged."""

    name = "vllm"

    def __init__(
        self,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.85,
        enforce_eager: bool = False,
        **engine_kwargs: Any,
    ) -> None:
        self.engine_kwargs: dict[str, Any] = {
            "dtype": dtype,
            "max_model_len": max_model_len,
            "gpu_memory_utilization": gpu_memory_utilization,
            "enforce_eager": enforce_eager,
            **engine_kwargs,
        }
        self.llm: Any = None
        self.model_dir: Path | None = None
        self._eos_ids: set[int] = set()
        self._arch: dict[str, Any] = {}
        self._rank: int | None = None  # the engine's max LoRA rank; None: no adapters
        self._lora: Any = None  # the adapter every request uses (a vllm LoRARequest)
        self._lora_ids = itertools.count(1)

    def load(self, model_dir: Path, adapter_dir: Path | None = None, *, lora_rank: int | None = None) -> None:
        from vllm import LLM

        model_dir = Path(model_dir)
        safetensors_files(model_dir)
        # Built for adapters from the job's first version on: re-creating the engine when the first
        # adapter arrives took as long as creating it (73 s on a 2-core CPU).
        rank = _lora_rank(adapter_dir) if adapter_dir is not None else _fit_rank(lora_rank) if lora_rank else None
        self.close()
        t0 = time.monotonic()
        kwargs = {k: v for k, v in self.engine_kwargs.items() if v is not None}
        if rank is not None:  # LoRA: the engine serves the base; each request names the adapter
            kwargs.update(enable_lora=True, max_lora_rank=rank, max_loras=1)
        self.llm = LLM(
            model=str(model_dir),
            tokenizer=str(model_dir),
            load_format="safetensors",  # never unpickle .bin weights
            logprobs_mode="processed_logits",
            logits_processors=[LOGITS_PROCESSOR_FQCN],
            worker_extension_cls=WORKER_EXTENSION_FQCN,
            **kwargs,
        )
        self.model_dir, self._rank = model_dir, rank
        self.precision = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")
        self._use_adapter(adapter_dir)
        self._arch = _arch_signature(model_dir)
        self._eos_ids = model_eos_token_ids(model_dir)
        eos = getattr(self.llm.get_tokenizer(), "eos_token_id", None)
        if eos is not None:
            self._eos_ids.add(int(eos))
        log.info("vLLM engine for %s ready in %.1fs", model_dir, time.monotonic() - t0)

    def reload(self, model_dir: Path, adapter_dir: Path | None = None) -> None:
        model_dir = Path(model_dir)
        safetensors_files(model_dir)
        if self._rank is not None and adapter_dir is not None and model_dir == self.model_dir and \
                _lora_rank(adapter_dir) <= self._rank:
            self._use_adapter(adapter_dir)  # a new adapter on the same base: the engine stays
            return
        adapters_changed = (self._rank is None) != (adapter_dir is None)
        if self.llm is None or _arch_signature(model_dir) != self._arch or adapters_changed:
            log.info("architecture or adapter use changed (or no engine): re-creating the vLLM engine")
            self.load(model_dir, adapter_dir)
            return
        t0 = time.monotonic()
        results = self.llm.collective_rpc("echo2_reload_weights", args=(str(model_dir),))
        if any(r is False for r in results):  # a vLLM without Worker.reload_weights
            log.warning("this vLLM cannot reload weights in place; re-creating the engine")
            self.load(model_dir)
            return
        self.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights
        self.model_dir = model_dir
        log.info("reloaded weights in place from %s in %.1fs", model_dir, time.monotonic() - t0)

    def generate(self, requests: list[GenRequest]) -> list[list[GenSample]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.llm is None:
            raise BackendError("generate() before load()")
        if not requests:
            return []
        prompts, params = [], []
        for r in requests:
            stops = sorted((self._eos_ids if r.stop_at_eos else set()) | set(r.stop_token_ids))
            for seed in r.seeds:
                prompts.append(TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)))
                params.append(
                    SamplingParams(
                        n=1,
                        temperature=r.temperature,
                        max_tokens=r.max_new_tokens,
                        extra_args={SAMPLER_KEY: {"seed": int(seed) % 2**32, "start": r.start_position,
                                                  "top_k": r.top_k, "top_p": r.top_p}},
                        stop_token_ids=stops,
                        ignore_eos=not r.stop_at_eos,
                        logprobs=0,  # just the sampled token's value
                        skip_special_tokens=True,
                        # text = decode(token_ids) like the transformers backend, stop token included
                        include_stop_str_in_output=True,
                    )
                )
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora)
        samples = [_to_sample(o.outputs[0]) for o in outputs]
        grouped, start = [], 0
        for r in requests:
            grouped.append(samples[start : start + r.n])
            start += r.n
        return grouped

    def _use_adapter(self, adapter_dir: Path | None) -> None:
        """Name `adapter_dir` in every request from now on. Each adapter gets a new id: vLLM caches
        adapters by id, so a new version is never served from the old one's cache."""
        if adapter_dir is None:
            self._lora = None
            return
        from vllm.lora.request import LoRARequest

        adapter_files(adapter_dir)
        if self._lora is not None:
            self.llm.llm_engine.remove_lora(self._lora.lora_int_id)
        lora_id = next(self._lora_ids)
        self._lora = LoRARequest(f"echo2-{lora_id}", lora_id, str(adapter_dir))

    def close(self) -> None:
        if self.llm is None:
            return
        llm, self.llm = self.llm, None
        engine = getattr(llm, "llm_engine", None)
        shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if callable(shutdown):
            shutdown()
        del llm, engine
        gc.collect()  # so that a re-created engine finds the memory free


def _to_sample(completion: Any) -> GenSample:
    token_ids = [int(t) for t in completion.token_ids]
    if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
        raise BackendError("vLLM returned no logprob for some sampled tokens")
    logprobs = [float(step[tok].logprob) for tok, step in zip(token_ids, completion.logprobs, strict=True)]
    reason = completion.finish_reason
    if reason not in ("stop", "length"):
        raise BackendError(f"vLLM finished a sample with reason {reason!r}")
    return GenSample(token_ids=token_ids, logprobs=logprobs, finish_reason=reason, text=completion.text)


class Echo2WorkerExtension:
    """Mixed into vLLM's worker class (worker_extension_cls): its methods are what
    `collective_rpc` can call by name, with only strings crossing the process boundary."""

    def echo2_reload_weights(self, weights_path: str) -> bool:
        if not hasattr(self, "reload_weights"):
            return False
        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        _refresh_cpu_packed_weights(self)
        return True


def _refresh_cpu_packed_weights(worker: Any) -> int:
    """Re-pack CPU GEMM weights that vLLM 0.32's in-place reload leaves stale.

    On CPU, vLLM prepacks every linear weight (oneDNN / sgl kernels). The reload re-packs each layer
    it loads, but a tied lm_head (tie_word_embeddings) loads nothing itself: it shares the embedding
    Parameter, whose data is updated, while its packed copy keeps the old values, so logits would
    come from the old embedding. Layers that kept their weight (remove_weight=False) are re-packed
    here from it. No-op on GPUs, where the lm_head multiplies by the shared Parameter directly.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    count = 0
    for module in worker.model_runner.get_model().modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.numel() > 0:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            count += 1
    return count


def _fit_rank(r: int, what: str = "the job's adapter") -> int:
    """The engine's max LoRA rank for an adapter of rank r: the smallest size vLLM offers that fits it."""
    fitting = [size for size in LORA_RANKS if size >= r]
    if r < 1 or not fitting:
        raise BackendError(f"{what}: LoRA rank {r} is not one vLLM can serve (1..{LORA_RANKS[-1]})")
    return fitting[0]


def _lora_rank(adapter_dir: Path) -> int:
    config, _ = adapter_files(adapter_dir)
    return _fit_rank(int(config.get("r", 0) or 0), str(adapter_dir))  # type: ignore[call-overload]


def _arch_signature(model_dir: Path) -> dict[str, Any]:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise BackendError(f"{model_dir}/config.json is unreadable: {exc}") from exc
    return {key: config.get(key) for key in _ARCH_FIELDS}


_processor_class: type | None = None


def _build_processor_class() -> type:
    """Defined on first use so that importing this module does not import vllm."""
    import torch
    from echo2.sampler import RowSettings, draw
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class ReplayableSampler(LogitsProcessor):
        """Draws each row's token with echo2.sampler and leaves it the row's only finite logit, holding its
        behaviour logprob (the module docstring says why vLLM then returns exactly that token and value)."""

        def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
            self.rows: dict[int, tuple[dict[str, Any], list[int]]] = {}  # batch index -> (settings, outputs)

        def is_argmax_invariant(self) -> bool:
            return True

        def update_state(self, batch_update: Any) -> None:
            if batch_update is None:
                return
            for index in batch_update.removed:
                self.rows.pop(index, None)
            for index, params, _, output_ids in batch_update.added:
                args = (params.extra_args or {}).get(SAMPLER_KEY) if params is not None else None
                if args is None:
                    self.rows.pop(index, None)
                else:
                    self.rows[index] = (args, output_ids)
            for a, b, direction in batch_update.moved:  # a -> b, or a <-> b
                at_a, at_b = self.rows.pop(a, None), self.rows.pop(b, None)
                if at_a is not None:
                    self.rows[b] = at_a
                if direction.name == "SWAP" and at_b is not None:
                    self.rows[a] = at_b

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            mine = sorted(i for i in self.rows if i < logits.shape[0])
            if not mine:
                return logits
            index = torch.tensor(mine, device=logits.device)
            args = [self.rows[i][0] for i in mine]
            settings = RowSettings.of([(1.0, a["top_k"], a["top_p"]) for a in args], logits.device)  # T applied
            seeds = torch.tensor([a["seed"] for a in args], dtype=torch.int64, device=logits.device)
            positions = torch.tensor([a["start"] + len(self.rows[i][1]) for a, i in zip(args, mine, strict=True)],
                                     dtype=torch.int64, device=logits.device)
            tokens, logprobs = draw(logits.index_select(0, index), settings, seeds, positions)
            rows = torch.full((len(mine), logits.shape[1]), float("-inf"), dtype=logits.dtype, device=logits.device)
            rows.scatter_(1, tokens.unsqueeze(1), logprobs.to(logits.dtype).unsqueeze(1))
            logits.index_copy_(0, index, rows)
            return logits

    ReplayableSampler.__module__ = __name__
    return ReplayableSampler


def __getattr__(name: str) -> Any:
    # vLLM resolves LOGITS_PROCESSOR_FQCN with getattr(module, "ReplayableSampler").
    global _processor_class
    if name == "ReplayableSampler":
        if _processor_class is None:
            _processor_class = _build_processor_class()
        return _processor_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
