"""`echo2-worker bench`: generation throughput (tokens/s, groups/s) and bandwidth to the server.

Generation is measured on a given HF folder, or on a tiny random-init Qwen2 built here (the worker
ships no model), with random prompt ids, seeded samples and the job-like shape G x max_new_tokens.
Bandwidth: download = GET /openapi.json repeatedly; upload = a 2 MB JSON body POSTed to
/v1/workers, which the server reads in full and refuses (422) - the API has no bandwidth probe.
"""

from __future__ import annotations

import json
import platform
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from echo2.loading import load_causal_lm

TINY = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 512, "tie_word_embeddings": True}
TINY_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz +-*/=?.,:#\n"


def build_bench_model(out: Path, seed: int = 0) -> Path:
    """A random-init Qwen2 with a character tokenizer: only its speed is of interest."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    vocab = {"<|endoftext|>": 0, "<|pad|>": 1} | {c: i + 2 for i, c in enumerate(TINY_CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    config = Qwen2Config(vocab_size=len(vocab), eos_token_id=0, bos_token_id=0, pad_token_id=1, **TINY)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # not Qwen2Tokenizer (config.json's model type)
    cfg_path.write_text(json.dumps(cfg))
    return out


def bench_generation(backend_name: str, model_dir: Path | None = None, *, prompts: int = 8, group_size: int = 4,
                     max_new_tokens: int = 32, prompt_len: int = 24, seconds: float = 5.0,
                     device: str = "auto") -> dict[str, Any]:
    from .backends import GenRequest, create_backend

    with tempfile.TemporaryDirectory(prefix="echo2-bench-") as tmp:
        folder = Path(model_dir) if model_dir else build_bench_model(Path(tmp) / "tiny")
        options = {"device": device} if backend_name == "transformers" else {}
        backend = create_backend(backend_name, **options)
        try:
            backend.load(folder)
            cfg = json.loads((folder / "config.json").read_text())
            vocab = int(cfg.get("vocab_size", 100))
            rng = random.Random(0)
            # No stop: every sample runs to max_new_tokens, so tokens/s compares with model.generate's below.
            requests = [GenRequest(prompt_token_ids=[rng.randrange(2, vocab) for _ in range(prompt_len)], n=group_size,
                                   seeds=[rng.randrange(2**31) for _ in range(group_size)],
                                   max_new_tokens=max_new_tokens, stop_at_eos=False) for _ in range(prompts)]
            backend.generate(requests[:1])  # warm-up
            calls, tokens, t0 = 0, 0, time.monotonic()
            while calls == 0 or time.monotonic() - t0 < seconds:
                out = backend.generate(requests)
                tokens += sum(len(s.token_ids) for group in out for s in group)
                calls += 1
            elapsed = time.monotonic() - t0
            precision = backend.precision
        finally:
            backend.close()
        generate = generate_tokens_per_s(folder, requests, device, precision)
    return {
        "backend": backend_name, "model": str(model_dir) if model_dir else "tiny (random Qwen2, 2 layers, 128 wide)",
        "tokens_per_s": round(tokens / elapsed, 1), "groups_per_s": round(calls * prompts / elapsed, 3),
        "generate_tokens_per_s": round(generate, 1), "vs_generate": round(tokens / elapsed / generate, 3),
        "group_size": group_size, "max_new_tokens": max_new_tokens, "seconds": round(elapsed, 2),
        "machine": f"{platform.machine()} {platform.system()}",
    }


def generate_tokens_per_s(folder: Path, requests: list[Any], device: str, precision: str) -> float:
    """transformers' `model.generate` sampling the same rows on the same device in the same dtype, every row to
    max_new_tokens, logits returned as a sampler for RL needs them: the baseline `vs_generate` compares with."""
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    model = load_causal_lm(folder, dtype=getattr(torch, precision)).to(device).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([r.prompt_token_ids for r in requests for _ in range(r.n)], device=device)
    new = requests[0].max_new_tokens
    with torch.inference_mode():
        model.generate(ids[:1], do_sample=True, max_new_tokens=2, pad_token_id=0)  # warm-up
        t0 = time.monotonic()
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, max_new_tokens=new,
                       output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        return ids.shape[0] * new / (time.monotonic() - t0)


def bench_bandwidth(server: str, provider_token: str | None = None, seconds: float = 2.0) -> dict[str, Any]:
    """Mbit/s down and up between this machine and the control plane (small, bounded probes)."""
    result: dict[str, Any] = {}
    with httpx.Client(base_url=server.rstrip("/"), timeout=30) as http:
        got, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < seconds / 2 or got == 0:
            got += len(http.get("/openapi.json").content)
        result["download_mbps"] = round(got * 8 / 1e6 / (time.monotonic() - t0), 1)
        if provider_token:
            body = json.dumps({"name": "x" * (2 * 2**20)}).encode()
            sent, t0 = 0, time.monotonic()
            headers = {"Authorization": f"Bearer {provider_token}", "Content-Type": "application/json"}
            while time.monotonic() - t0 < seconds / 2 or sent == 0:
                http.post("/v1/workers", content=body, headers=headers)  # read in full, then refused
                sent += len(body)
            result["upload_mbps"] = round(sent * 8 / 1e6 / (time.monotonic() - t0), 1)
    return result
