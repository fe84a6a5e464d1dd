"""Transformers generation backend: a manual KV-cached decode loop on CPU or one GPU.

Why not `model.generate`: every sample must draw from its own seeded torch.Generator so that a
sample is a pure function of (weights, prompt, seed), and every sampled token needs its logprob
under log_softmax(logits / T) before top-p (see base.py), which `generate` does not report.

Each prompt is prefilled once (requests batched with left padding); its KV cache rows are then
repeated for the group's n samples, which decode together until every row hits eos or its length.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo2.loading import LOAD_LOCK

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


class TransformersBackend(GenerationBackend):
    """Sampling with plain transformers; `device="auto"` picks CUDA when present (bf16 if supported)."""

    name = "transformers"

    def __init__(self, device: str = "auto", dtype: str = "auto", max_batch_rows: int = 64) -> None:
        self._device_arg = device
        self._dtype_arg = dtype
        self.max_batch_rows = max_batch_rows
        self.model: Any = None
        self.tokenizer: Any = None
        self.model_dir: Path | None = None
        self.adapter_dir: Path | None = None
        self._eos_ids: set[int] = set()

    # -- loading ---------------------------------------------------------------------------------

    def load(self, model_dir: Path, adapter_dir: Path | None = None, *, lora_rank: int | None = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model_dir = Path(model_dir)
        safetensors_files(model_dir)  # refuse pickle-only folders before transformers sees them
        device = self._resolve_device()
        dtype = self._resolve_dtype(device)
        t0 = time.monotonic()
        with LOAD_LOCK:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, use_safetensors=True).to(device)
            self.adapter_dir = None
            if adapter_dir is not None:
                self._wrap(Path(adapter_dir))
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model_dir = model_dir
        self._eos_ids = model_eos_token_ids(model_dir)
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

        out: list[list[GenSample]] = []
        with torch.inference_mode():
            for chunk in _chunks(requests, self.max_batch_rows):
                out.extend(self._generate_chunk(chunk))
        return out

    def _generate_chunk(self, requests: list[GenRequest]) -> list[list[GenSample]]:
        import torch

        device = self.model.device
        pad_id = min(self._eos_ids) if self._eos_ids else 0
        # Prefill every distinct prompt once, left padded.
        plen = max(len(r.prompt_token_ids) for r in requests)
        ids = torch.full((len(requests), plen), pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), plen), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, plen - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[i, plen - len(r.prompt_token_ids) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        res = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        # Fan out: one row per sample, in request order then seed order.
        rows = torch.tensor([i for i, r in enumerate(requests) for _ in range(r.n)], device=device)
        cache = res.past_key_values
        cache.reorder_cache(rows)
        logits = res.logits[:, -1, :].index_select(0, rows)
        mask = mask.index_select(0, rows)
        next_pos = positions[:, -1:].index_select(0, rows) + 1

        flat = [(r, seed) for r in requests for seed in r.seeds]
        sampler = _RowSampler(flat, device)
        stops = [(self._eos_ids if r.stop_at_eos else set()) | set(r.stop_token_ids) for r, _ in flat]
        limits = [r.max_new_tokens for r, _ in flat]
        tokens: list[list[int]] = [[] for _ in flat]
        logprobs: list[list[float]] = [[] for _ in flat]
        finish: list[str | None] = [None] * len(flat)

        for step in range(max(limits)):
            picked, picked_lp = sampler.sample(logits)
            for b, (tok, lp) in enumerate(zip(picked.tolist(), picked_lp.tolist(), strict=True)):
                if finish[b] is not None:
                    continue
                tokens[b].append(tok)
                logprobs[b].append(lp)
                if tok in stops[b]:
                    finish[b] = "stop"
                elif len(tokens[b]) >= limits[b]:
                    finish[b] = "length"
            if all(f is not None for f in finish) or step == max(limits) - 1:
                break
            # Finished rows keep decoding (their outputs are ignored) so the batch stays rectangular.
            mask = torch.cat([mask, mask.new_ones((len(flat), 1))], dim=1)
            res = self.model(
                input_ids=picked.unsqueeze(1),
                attention_mask=mask,
                position_ids=next_pos,
                past_key_values=cache,
                use_cache=True,
            )
            cache, logits, next_pos = res.past_key_values, res.logits[:, -1, :], next_pos + 1

        samples = [
            GenSample(
                token_ids=tokens[b],
                logprobs=logprobs[b],
                finish_reason=finish[b] or "length",  # type: ignore[arg-type]
                text=self.tokenizer.decode(tokens[b], skip_special_tokens=True),
            )
            for b in range(len(flat))
        ]
        grouped, start = [], 0
        for r in requests:
            grouped.append(samples[start : start + r.n])
            start += r.n
        return grouped


class _RowSampler:
    """Per-row temperature / top-p sampling, each row drawing from its own seeded generator."""

    def __init__(self, flat: list[tuple[GenRequest, int]], device: Any) -> None:
        import torch

        self.temps = torch.tensor([[r.temperature] for r, _ in flat], dtype=torch.float32, device=device)
        self.top_ps = torch.tensor([[r.top_p] for r, _ in flat], dtype=torch.float32, device=device)
        self.top_ks = torch.tensor([[r.top_k] for r, _ in flat], dtype=torch.long, device=device)
        self.generators = []
        for _, seed in flat:
            g = torch.Generator(device=device)
            g.manual_seed(int(seed) % (2**63))
            self.generators.append(g)

    def sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the sampled ids and their behaviour logprobs (before top-p), both shape (rows,)."""
        import torch

        logp = torch.log_softmax(logits.float() / self.temps, dim=-1)
        probs = logp.exp()
        if bool((self.top_ps < 1).any()) or bool((self.top_ks > 0).any()):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            rank = torch.arange(sorted_p.shape[-1], device=sorted_p.device)
            sorted_p = sorted_p.masked_fill((self.top_ks > 0) & (rank >= self.top_ks), 0.0)  # top-k first
            # Then the smallest prefix whose mass reaches top_p of what top-k kept (the top token survives).
            drop = (sorted_p.cumsum(-1) - sorted_p) >= self.top_ps * sorted_p.sum(-1, keepdim=True)
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        picked = torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(self.generators)])
        return picked, logp.gather(-1, picked.unsqueeze(-1)).squeeze(-1)


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
