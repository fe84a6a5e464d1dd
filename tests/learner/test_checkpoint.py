"""Checkpoints on disk: a write cut short (the learner killed while `ckpt-N.tmp` is half written)
leaves `latest` on the previous complete checkpoint, which loads; the next save of that step
replaces the leftover and prunes to the newest `keep`."""

from __future__ import annotations

import torch
from echo2.loading import load_causal_lm

from learner import checkpoint
from learner.parallel import Solo


def _trainer(tiny_dir):
    model = load_causal_lm(tiny_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


def _save(root, step, model, optimizer, scheduler):
    world = Solo()
    return checkpoint.save(root, step, step, world.model_state(model), world.optimizer_state(model, optimizer),
                           scheduler, {f"r{step}"}, keep=2)


def test_interrupted_write_resumes_from_the_previous_checkpoint(tiny_dir, tmp_path):
    model, optimizer, scheduler = _trainer(tiny_dir)
    root = tmp_path / "checkpoints"
    _save(root, 3, model, optimizer, scheduler)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    partial = root / "ckpt-6.tmp"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\0" * 100)  # what a kill mid-write leaves

    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    restored = checkpoint.load_latest(root, model, optimizer, scheduler, Solo())
    assert (restored.step, restored.version, restored.consumed) == (3, 3, {"r3"})
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())

    for step in (6, 9):
        _save(root, step, model, optimizer, scheduler)
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-6", "ckpt-9", "latest"]
    assert checkpoint.load_latest(root, model, optimizer, scheduler, Solo()).step == 9
