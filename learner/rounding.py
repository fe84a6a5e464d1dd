"""The learner computes on the weights it publishes.

The learner keeps float32 master weights, and the optimiser (AdamW) and its state work on them. A version
is the masters rounded to the published dtype (bfloat16 for most released models). Were the learner to
compute its forward on the masters, it would train a policy that workers never sample: an AdamW step at an
RL learning rate (2e-6) moves a weight 10-100 times less than half a bf16 step, so the published weights
stay put for tens of steps while the learner's move on and the importance ratio between them drifts
(docs/BENCHMARKS.md, "bf16 versions and small learning rates"). So the forward, its backward and the
logprobs the ratio uses all run on the rounded masters (`Rounder.computing`): gradients are taken with
respect to the published weights and applied to the masters, which keep every update until it changes a
published weight (mixed-precision training's master weights, with the published dtype as the compute
weights' grid).

Two roundings (`WeightsConfig.rounding`):
- nearest: the plain cast, round to nearest, ties to even (what `tensor.to(torch.bfloat16)` does).
- dithered (bfloat16 only): the master's float32 bits plus a random 16-bit threshold fixed per weight,
  truncated to bfloat16: p = trunc(m + u * ulp), u uniform in [0, 1) per weight, drawn once from the job's
  seed. A master that sits on the bf16 grid is published unchanged (version 0 is the base, bit for bit);
  a master that moved by d (a fraction d / ulp of a step) is published one step further for a share
  d / ulp of the weights, so on average the published weights move as far as the masters, where nearest
  drops every move smaller than half a step. A weight still changes only when its master crosses its
  threshold, so versions stay as sparse as with nearest.

The rounded values are held in float32 tensors: on a CPU float32 arithmetic is the fast one, and on a GPU
bf16 autocast casts them to bf16 exactly (they are on the grid). Frozen parameters (a LoRA job's base, a
KL reference) never change, so they are rounded once, in place.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

LOW_BITS = 0xFFFF  # the float32 bits below bfloat16's precision
DITHER_SALT = 0x5EED_D17E


def nearest(master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The master rounded to nearest in `dtype`, kept in the master's dtype."""
    return master.to(dtype).to(master.dtype)


def dithered(master: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """A float32 master truncated to bfloat16 after adding `threshold` (int32 in [0, 0xFFFF]) to its bits.
    Sign-magnitude bits: adding to them moves the magnitude up, so the rounding is symmetric in sign."""
    bits = master.contiguous().view(torch.int32)
    return ((bits + threshold) & ~LOW_BITS).view(torch.float32)


def thresholds(shape: torch.Size, device: torch.device, seed: int, index: int) -> torch.Tensor:
    """The fixed random thresholds of parameter number `index`: a pure function of (seed, index, device type),
    so a resumed learner rounds as its predecessor did."""
    gen = torch.Generator(device=device).manual_seed((seed * 1_000_003 + index) ^ DITHER_SALT)
    return torch.randint(0, LOW_BITS + 1, shape, generator=gen, device=device, dtype=torch.int32)


class Rounder:
    """The trainable parameters of `model` as the published weights (module docstring). `dtype` float32
    means no rounding at all."""

    def __init__(self, model: Any, dtype: torch.dtype, dithered: bool = False, seed: int = 0) -> None:
        if dithered and dtype != torch.bfloat16:
            raise ValueError("dithered rounding applies to bfloat16 versions only")
        self.dtype, self.dithered, self.seed = dtype, dithered, seed
        params = [p for p in model.parameters() if p.is_floating_point()]
        self.params = [p for p in params if p.requires_grad]
        self._thresholds: dict[int, torch.Tensor] = {}
        if self.rounds:
            with torch.no_grad():
                for p in params:
                    if not p.requires_grad and p.dtype == torch.float32:
                        p.copy_(nearest(p, dtype))

    @property
    def rounds(self) -> bool:
        return self.dtype != torch.float32

    def rounded(self, index: int, master: torch.Tensor) -> torch.Tensor:
        """Trainable parameter number `index`'s master as published (a new tensor)."""
        if not self.dithered or master.dtype != torch.float32:
            return nearest(master, self.dtype)
        return dithered(master, self._threshold(index, master))

    def _threshold(self, index: int, master: torch.Tensor) -> torch.Tensor:
        # Regenerated rather than kept: 4 bytes a weight is more memory than the time it saves.
        return thresholds(master.shape, master.device, self.seed, index)

    @contextmanager
    def computing(self) -> Iterator[None]:
        """Inside, the trainable parameters hold the published weights; their gradients stay on them for the
        optimiser, and the masters come back on the way out (also on an error)."""
        if not self.rounds:
            yield
            return
        masters = [p.data for p in self.params]
        try:
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    p.data = self.rounded(i, p.data)
            yield
        finally:
            for p, m in zip(self.params, masters, strict=True):
                p.data = m
