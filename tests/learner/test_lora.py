"""LoRA jobs on the tiny model: only the adapter trains; version 0 is the base, later versions the adapter
alone, the final one the merged model with its adapter; the worker's transformers backend loads base +
adapter and reports exactly the learner's logprobs, and swaps adapters in place."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from echo2.loading import load_causal_lm
from echo2.protocol import JobSpec
from echo2_worker.backends.base import GenRequest
from echo2_worker.backends.transformers_backend import TransformersBackend
from safetensors.torch import load_file

from learner.loop import LearnerOptions, build_trainer
from learner.parallel import Solo
from learner.policy import completion_logprobs, pad_batch
from learner.weights import ADAPTER_DIR, Role

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture
def trainer(tiny_dir: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    spec = JobSpec.model_validate({"name": "lora", "base_model": str(tiny_dir), "task": {"name": "arithmetic"},
                                   "lora": LORA})
    trainer, _ = build_trainer(spec, str(tiny_dir), LearnerOptions(work_dir=tmp_path), Solo(), tmp_path / "ckpt")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # as if trained: a non-zero adapter
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return trainer


def logprobs(model, batch) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """On the CPU, wherever the model is (the learner takes a CUDA GPU where there is one)."""
    with torch.no_grad():
        return completion_logprobs(model.eval(), batch.to(model.device)).cpu()


def test_only_the_adapter_trains(trainer):
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(trainable)


def test_versions_are_the_base_then_the_adapter_then_the_merged_model(trainer, tiny_dir: Path, tmp_path: Path):
    tok, weights = trainer.tokenizer, trainer.weights
    state = weights.snapshot()
    assert state and all("lora_" in k for k in state)  # a snapshot is the adapter alone
    weights.write(state, tmp_path / "v0", Role.first)
    base, published_base = load_file(str(tiny_dir / "model.safetensors")), load_file(str(tmp_path / "v0" /
                                                                                            "model.safetensors"))
    assert set(base) ^ set(published_base) <= {"lm_head.weight"}  # tied to the embedding: stored once or twice
    assert all(torch.equal(base[k], published_base[k]) for k in set(base) & set(published_base))
    weights.write(state, tmp_path / "v1", Role.next)
    assert sorted(p.name for p in (tmp_path / "v1").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((tmp_path / "v1" / "adapter_config.json").read_text())["r"] == 4
    weights.write(state, tmp_path / "final", Role.final)
    assert (tmp_path / "final" / ADAPTER_DIR / "adapter_model.safetensors").exists()
    batch = pad_batch([tok("12+7=")["input_ids"]], [tok("19")["input_ids"]], tok.pad_token_id)
    merged = load_causal_lm(tmp_path / "final", dtype=torch.float32)
    assert torch.allclose(logprobs(merged, batch), logprobs(trainer.model, batch), atol=1e-5)


def test_the_transformers_backend_samples_base_plus_adapter_with_the_learners_logprobs(trainer, tmp_path: Path):
    tok, weights = trainer.tokenizer, trainer.weights
    weights.write(weights.snapshot(), tmp_path / "v0", Role.first)
    weights.write(weights.snapshot(), tmp_path / "v1", Role.next)
    backend = TransformersBackend(device="cpu")
    backend.load(tmp_path / "v0", tmp_path / "v1")
    prompt = tok("3+4=")["input_ids"]
    [group] = backend.generate([GenRequest(prompt_token_ids=prompt, n=3, seeds=[1, 2, 3], max_new_tokens=6)])
    batch = pad_batch([prompt] * 3, [s.token_ids for s in group], tok.pad_token_id)
    learner = logprobs(trainer.model, batch)
    for i, s in enumerate(group):
        assert learner[i, : len(s.token_ids)].tolist() == pytest.approx(s.logprobs, abs=1e-4)

    with torch.no_grad():  # the next version's adapter, swapped in place: the same as a fresh load
        for name, p in trainer.model.named_parameters():
            if "lora_A" in name:
                p.mul_(-1.5)
    weights.write(weights.snapshot(), tmp_path / "v2", Role.next)
    backend.reload(tmp_path / "v0", tmp_path / "v2")
    swapped = backend.generate([GenRequest(prompt_token_ids=prompt, n=3, seeds=[1, 2, 3], max_new_tokens=6)])
    fresh = TransformersBackend(device="cpu")
    fresh.load(tmp_path / "v0", tmp_path / "v2")
    assert swapped == fresh.generate([GenRequest(prompt_token_ids=prompt, n=3, seeds=[1, 2, 3], max_new_tokens=6)])
