"""Learner checkpoints: weights (safetensors), optimiser + scheduler + RNG, step, version counter and the
consumed rollout ids. Written into `ckpt-N.tmp`, fsynced, renamed; `latest` is updated last.

The caller passes full CPU states (`parallel.Solo`/`Sharded`: with FSDP, rank 0 gathers them and writes
alone); on load, every rank reads the files and `parallel` puts the weights and optimiser state back."""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from echo2.snapshots import atomic_write, replace_dir
from safetensors.torch import load_file, save_file

from .parallel import Solo


@dataclass
class Restored:
    step: int
    version: int | None
    consumed: set[str]


def save(root: Path, step: int, version: int | None, weights: dict[str, torch.Tensor], optim: dict[str, Any],
         scheduler: Any, consumed: set[str], keep: int = 2) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"ckpt-{step}", root / f"ckpt-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(_untie({k: v.contiguous() for k, v in weights.items()}), str(tmp / "model.safetensors"))
    torch.save({"optimizer": optim, "scheduler": scheduler.state_dict(),
                "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}, tmp / "trainer.pt")
    (tmp / "meta.json").write_text(json.dumps({"step": step, "version": version, "consumed": sorted(consumed)}))
    for f in tmp.iterdir():
        _fsync(f)
    replace_dir(tmp, final)
    atomic_write(root / "latest", final.name.encode())
    _prune(root, keep)
    return final


def latest_step(root: Path) -> int | None:
    """The step of the checkpoint `latest` points to, without loading it."""
    pointer = root / "latest"
    if not pointer.exists():
        return None
    return int(json.loads((root / pointer.read_text().strip() / "meta.json").read_text())["step"])


def load_latest(root: Path, model: Any, optimizer: Any, scheduler: Any, world: Solo) -> Restored | None:
    pointer = root / "latest"
    if not pointer.exists():
        return None
    folder = root / pointer.read_text().strip()
    # weights_only: tensors and plain containers only, no code, even from a checkpoint fetched back from
    # the control plane
    trainer = torch.load(folder / "trainer.pt", weights_only=True)
    world.restore(model, optimizer, load_file(str(folder / "model.safetensors")), trainer["optimizer"])
    scheduler.load_state_dict(trainer["scheduler"])
    torch.set_rng_state(trainer["torch_rng"])
    random.setstate(trainer["python_rng"])
    meta = json.loads((folder / "meta.json").read_text())
    return Restored(step=meta["step"], version=meta["version"], consumed=set(meta["consumed"]))


def _untie(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors sharing memory (tied embeddings): store a copy of each duplicate.
    seen: set[int] = set()
    out = {}
    for k, v in state.items():
        ptr = v.data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return out


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _prune(root: Path, keep: int) -> None:
    done = sorted((p for p in root.glob("ckpt-*") if not p.name.endswith(".tmp")),
                  key=lambda p: int(p.name.split("-")[1]))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
