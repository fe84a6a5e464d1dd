"""Transformers generation backend: a manual KV-cached decode loop on CPU or one GPU.

Why not `model.generate`: every token must be drawn by the replayable sampler (echo2.sampler: a pure
function of the logits, the settings, the sample's seed and the token's position, one batched draw for
all rows), and every sampled token needs its logprob under log_softmax(logits / T) before top-p (see
base.py), which `generate` does not report.

Each prompt is prefilled once (requests batched with left padding); its KV cache rows are then
repeated for the group's n samples, which decode together until every row hits a stop token or its
length. Tokens, logprobs and stop checks stay on the device until the batch is done. On a GPU the decode
steps write into a pre-allocated (static) KV cache instead of growing one by concatenation, which copies
the whole cache every token; `compile_decode` also compiles the step with CUDA graphs (torch.compile's
"reduce-overhead"), which pays off where per-step launch overhead dominates (small models).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo2.loading import LOAD_LOCK, load_causal_lm
from echo2.modelinfo import context_length, folder_reader

from echo2_worker.backends.base import (
    BackendError,
    GenerationBackend,
    GenRequest,
    GenSample,
    adapter_files,
    model_eos_token_ids,
    safetensors_files,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
CPU_ROWS = 64  # rows decoded together on a CPU (or wherever max_batch_rows is unset and memory is not measured)
MAX_ROWS = 1024  # the most a GPU decodes together when its free memory sizes the batch
SYNC_EVERY = 8  # decode steps between two checks (device syncs) of whether every row is done


class TransformersBackend(GenerationBackend):
    """Sampling with plain transformers; `device="auto"` picks CUDA when present (bf16 if supported)."""

    name = "transformers"

    def __init__(self, device: str = "auto", dtype: str = "auto", max_batch_rows: int | None = None,
                 memory_share: float = 0.75, kv_cache: str = "auto", compile_decode: bool = False) -> None:
        if kv_cache not in ("auto", "static", "dynamic"):
            raise BackendError(f"kv_cache must be auto, static or dynamic, not {kv_cache!r}")
        self._device_arg = device
        self._dtype_arg = dtype
        self.kv_cache = kv_cache  # auto: static on a GPU, dynamic on a CPU (where the copies cost little)
        self.compile_decode = compile_decode
        self._step: Any = None
        self.max_batch_rows = max_batch_rows
        self.memory_share = memory_share  # of the free GPU memory the KV cache of a batch may take
        self.model: Any = None
        self.tokenizer: Any = None
        self.model_dir: Path | None = None
        self.adapter_dir: Path | None = None
        self._eos_ids: set[int] = set()
        self._context: int | None = None

    # -- loading ---------------------------------------------------------------------------------

    def load(self, model_dir: Path, adapter_dir: Path | None = None, *, lora_rank: int | None = None) -> None:
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        safetensors_files(model_dir)  # refuse pickle-only folders before transformers sees them
        device = self._resolve_device()
        dtype = self._resolve_dtype(device)
        t0 = time.monotonic()
        self.model = load_causal_lm(model_dir, dtype=dtype, use_safetensors=True).to(device)
        self.adapter_dir = None
        if adapter_dir is not None:
            self._wrap(Path(adapter_dir))
        self.model.eval()
        self._step = None
        self.precision = str(dtype).removeprefix("torch.")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model_dir = model_dir
        self._eos_ids = model_eos_token_ids(model_dir)
        self._context = context_length(folder_reader(model_dir))
        if self.tokenizer.eos_token_id is not None:
            self._eos_ids.add(int(self.tokenizer.eos_token_id))
        log.info("loaded %s%s on %s (%s) in %.1fs", model_dir, f" with adapter {adapter_dir}" if adapter_dir else "",
                 device, dtype, time.monotonic() - t0)

    def _wrap(self, adapter_dir: Path) -> None:
        from peft import PeftModel

        adapter_files(adapter_dir)
        with LOAD_LOCK:
            self.model = PeftModel.from_pretrained(self.model, adapter_dir)
        self.adapter_dir = adapter_dir

    def reload(self, model_dir: Path, adapter_dir: Path | None = None) -> None:
        """Copy the new folder's tensors into the live parameters (no re-instantiation); with an adapter
        on the base already loaded, only the adapter's.

        Every name and shape is checked from the safetensors headers before the first copy, so a
        folder of another architecture leaves the loaded weights untouched.
        """
        if self.model is None or (self.adapter_dir is None) != (adapter_dir is None) or (
                adapter_dir is not None and Path(model_dir) != self.model_dir):
            self.load(model_dir, adapter_dir)  # another base, or adapters on or off: load afresh
            return
        if adapter_dir is not None:
            self._copy_in(adapter_files(Path(adapter_dir))[1:], _adapter_params(self.model), adapter_dir)
            self.adapter_dir = Path(adapter_dir)
            return
        model_dir = Path(model_dir)
        self._copy_in(safetensors_files(model_dir), dict(self.model.state_dict()), model_dir)
        self.model_dir = model_dir

    def _copy_in(self, files: list[Path] | tuple[Path, ...], params: dict[str, Any], source: Path) -> None:
        import torch
        from safetensors import safe_open

        t0 = time.monotonic()
        covered: set[int] = set()  # storages that will be written; tied weights share one
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    target = params.get(key)
                    shape = tuple(f.get_slice(key).get_shape())
                    if target is None or tuple(target.shape) != shape:
                        have = None if target is None else tuple(target.shape)
                        raise BackendError(
                            f"{source}: tensor {key} {shape} does not fit the loaded model ({have}); "
                            "not the same architecture"
                        )
                    covered.add(target.data_ptr())
        missing = [k for k, t in params.items() if t.data_ptr() not in covered]
        if missing:
            raise BackendError(f"{source} lacks {len(missing)} tensors, e.g. {missing[:3]}")
        with torch.no_grad():
            for file in files:
                with safe_open(str(file), framework="pt") as f:
                    for key in f.keys():  # noqa: SIM118
                        params[key].copy_(f.get_tensor(key))  # copy_ casts dtype and moves device
        log.info("reloaded weights from %s in %.1fs", source, time.monotonic() - t0)

    def close(self) -> None:
        self.model = None
        self.tokenizer = None
        self._step = None

    def _resolve_device(self) -> str:
        import torch

        if self._device_arg != "auto":
            return self._device_arg
        return "cuda" if torch.cuda.is_available() else "cpu"

    def _resolve_dtype(self, device: str) -> torch.dtype:
        import torch

        if self._dtype_arg != "auto":
            return getattr(torch, self._dtype_arg)
        if device.startswith("cuda") and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32

    # -- generation ------------------------------------------------------------------------------

    def generate(self, requests: list[GenRequest]) -> list[list[GenSample]]:
        if self.model is None:
            raise BackendError("generate() before load()")
        import torch

        requests = [self._within_context(r) for r in requests]
        out: list[list[GenSample]] = []
        with torch.inference_mode():
            for chunk in _chunks(requests, self._row_budget(requests)):
                out.extend(self._generate_chunk(chunk))
        return out

    def _within_context(self, request: GenRequest) -> GenRequest:
        """A sample stops where the model's context ends (finish "length"), as vLLM's do: the door refuses one
        that goes past it. (A prompt that alone fills the context is generated past it, as before: vLLM refuses
        such a prompt, and a model with rotary positions still reads it.)"""
        prompt, context = len(request.prompt_token_ids), self._context
        if context is None or prompt >= context or prompt + request.max_new_tokens <= context:
            return request
        return dataclasses.replace(request, max_new_tokens=context - prompt)

    def _row_budget(self, requests: list[GenRequest]) -> int:
        """Rows decoded together: `max_batch_rows`, or on a GPU with it unset, as many as the KV cache of
        the longest prompt and completion fits in `memory_share` of the free memory (at least one group)."""
        if self.max_batch_rows is not None or self.model.device.type != "cuda":
            return self.max_batch_rows or CPU_ROWS
        import torch

        free, _ = torch.cuda.mem_get_info(self.model.device)
        prompt = max(len(r.prompt_token_ids) for r in requests)
        longest = prompt + max(r.max_new_tokens for r in requests)
        if self._static():
            longest += prompt  # the prefilled cache is copied into the static one: both are held for a moment
        per_row = kv_bytes_per_token(self.model.config, self.model.dtype) * longest
        return max(max(r.n for r in requests), min(MAX_ROWS, int(self.memory_share * free / max(per_row, 1))))

    def _generate_chunk(self, requests: list[GenRequest]) -> list[list[GenSample]]:
        device = self.model.device
        rows = _Rows(requests, self._eos_ids, device)
        logits, cache, mask, next_pos = self._prefill(requests, rows.fanout)
        longest = int(max(r.max_new_tokens for r in requests))
        if self._static():
            cache = _static_cache(self.model, cache, mask.shape[1] + longest)
        tokens, logprobs, lengths, stopped = _decode(self._decode_step(), rows, logits, cache, mask, next_pos,
                                                     static=self._static())
        flat = zip(tokens.tolist(), logprobs.tolist(), lengths.tolist(), stopped.tolist(), strict=True)
        samples = [GenSample(token_ids=t[:n], logprobs=lp[:n], finish_reason="stop" if stop else "length",
                             text=self.tokenizer.decode(t[:n], skip_special_tokens=True))
                   for t, lp, n, stop in flat]
        grouped, start = [], 0
        for r in requests:
            grouped.append(samples[start : start + r.n])
            start += r.n
        return grouped

    def _static(self) -> bool:
        return self.kv_cache == "static" or (self.kv_cache == "auto" and self.model.device.type == "cuda")

    def _decode_step(self) -> Any:
        """The model's forward for one decode step; compiled once per backend where asked (static cache only:
        CUDA graphs need the cache's addresses fixed)."""
        if not (self.compile_decode and self._static()):
            return self.model
        if self._step is None:
            import torch

            self._step = torch.compile(self.model.forward, mode="reduce-overhead", dynamic=False)
        return self._step

    def _prefill(self, requests: list[GenRequest], fanout: Any) -> tuple[Any, Any, Any, Any]:
        """Every distinct prompt once (left padded); its KV cache rows are then repeated for its n samples.
        Returns the first logits, the cache, the attention mask and the next position of every row."""
        import torch

        device = self.model.device
        pad_id = min(self._eos_ids) if self._eos_ids else 0
        plen = max(len(r.prompt_token_ids) for r in requests)
        ids = torch.full((len(requests), plen), pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), plen), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, plen - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[i, plen - len(r.prompt_token_ids) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        res = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        cache = res.past_key_values
        cache.reorder_cache(fanout)
        logits = res.logits[:, -1, :].index_select(0, fanout)
        return logits, cache, mask.index_select(0, fanout), positions[:, -1:].index_select(0, fanout) + 1


class _Rows:
    """One row per sample, in request order then seed order: its sampling settings, seed, first position,
    length limit and stop ids, as tensors on the model's device."""

    def __init__(self, requests: list[GenRequest], eos_ids: set[int], device: Any) -> None:
        import torch
        from echo2.sampler import RowSettings

        flat = [(r, seed) for r in requests for seed in r.seeds]
        self.fanout = torch.tensor([i for i, r in enumerate(requests) for _ in range(r.n)], device=device)
        self.settings = RowSettings.of([(r.temperature, r.top_k, r.top_p) for r, _ in flat], device)
        self.seeds = torch.tensor([seed % 2**32 for _, seed in flat], dtype=torch.int64, device=device)
        self.start = torch.tensor([r.start_position for r, _ in flat], dtype=torch.int64, device=device)
        self.limits = torch.tensor([r.max_new_tokens for r, _ in flat], dtype=torch.int64, device=device)
        stops = [sorted((eos_ids if r.stop_at_eos else set()) | set(r.stop_token_ids)) for r, _ in flat]
        width = max(1, max(len(s) for s in stops))
        self.stops = torch.tensor([s + [-1] * (width - len(s)) for s in stops], dtype=torch.int64, device=device)


def _decode(forward: Any, rows: _Rows, logits: Any, cache: Any, mask: Any, next_pos: Any,
            static: bool = False) -> tuple[Any, Any, Any, Any]:
    """Decode every row to its stop token or its limit with the replayable sampler. Everything stays on the
    device: a GPU is synchronised only every SYNC_EVERY steps, to see whether all rows are done (finished
    rows keep decoding meanwhile, their tokens ignored, so the batch stays rectangular). The attention mask
    is allocated at its final width; a static cache is given all of it (its keys span that width), a
    dynamic one the columns filled so far."""
    import torch
    from echo2.sampler import draw

    n, longest = len(rows.seeds), int(rows.limits.max())
    tokens = torch.zeros((n, longest), dtype=torch.long, device=logits.device)
    logprobs = torch.zeros((n, longest), dtype=torch.float32, device=logits.device)
    lengths, stopped = rows.limits.clone(), torch.zeros(n, dtype=torch.bool, device=logits.device)
    done = torch.zeros(n, dtype=torch.bool, device=logits.device)
    sync_every = 1 if logits.device.type == "cpu" else SYNC_EVERY
    width = mask.shape[1]
    mask = torch.cat([mask, mask.new_zeros((n, longest))], dim=1)
    for step in range(longest):
        picked, picked_lp = draw(logits, rows.settings, rows.seeds, rows.start + step)
        tokens[:, step], logprobs[:, step] = picked, picked_lp
        hit = (picked.unsqueeze(-1) == rows.stops).any(-1) & ~done
        ending = hit | (~done & (rows.limits <= step + 1))
        lengths = torch.where(ending, step + 1, lengths)
        stopped, done = stopped | hit, done | ending
        if step == longest - 1 or (step % sync_every == sync_every - 1 and bool(done.all())):
            break
        mask[:, width + step] = 1
        seen = mask if static else mask[:, : width + step + 1]
        res = forward(input_ids=picked.unsqueeze(1), attention_mask=seen, position_ids=next_pos, past_key_values=cache,
                      use_cache=True)
        logits, next_pos = res.logits[:, -1, :], next_pos + 1
    return tokens, logprobs, lengths, stopped


def _static_cache(model: Any, prefilled: Any, width: int) -> Any:
    """A StaticCache of `width` positions holding the prefilled (already fanned-out) keys and values,
    written through the cache's public update()."""
    from transformers import StaticCache

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cache = StaticCache(config=config, max_cache_len=width)
    for i, layer in enumerate(prefilled.layers):
        cache.update(layer.keys, layer.values, i)
    return cache


def kv_bytes_per_token(config: Any, dtype: Any) -> int:
    """Bytes of KV cache one token of one row holds: keys and values of every layer."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * dtype.itemsize


def _adapter_params(model: Any) -> dict[str, Any]:
    """The loaded adapter's tensors under the names peft saves them by (no adapter name in them)."""
    return {k.replace(".default.", "."): v for k, v in model.state_dict().items() if "lora_" in k}


def _chunks(requests: list[GenRequest], max_rows: int) -> list[list[GenRequest]]:
    """Split requests so each chunk decodes at most max_rows samples (a group is never split)."""
    chunks: list[list[GenRequest]] = []
    current: list[GenRequest] = []
    rows = 0
    for r in requests:
        if current and rows + r.n > max_rows:
            chunks.append(current)
            current, rows = [], 0
        current.append(r)
        rows += r.n
    if current:
        chunks.append(current)
    return chunks
