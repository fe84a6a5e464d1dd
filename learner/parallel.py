"""How the learner's model is laid out over processes.

`Solo` is one process (CPU or one GPU): every method is the plain single-process operation.
`Sharded` is one rank of a `torchrun` group (a job with `learner.gpus > 1`, see launch.py): the model
is wrapped with FSDP2 (`fully_shard`, one unit per decoder layer plus the root), rank 0 alone talks
to the control plane and *announces* each collective operation to the other ranks, which follow
(launch.follow). Announcements travel on a gloo group even on CUDA, so ranks waiting for the next
batch wait on a socket, not on a spinning GPU kernel.

Both offer the same methods, so the learner code reads the same for both:
- `announce(command, payload)`: rank 0 tells the followers what to do next (no-op for Solo);
- `wrap(model, dtype)`: shard the model (before the optimiser is built over its parameters); with FSDP
  the float32 shards are cast to `dtype` (the published one) as they are gathered, so the forward runs
  on the weights as published (learner/rounding.py does it for Solo);
- `model_state(model)`: a full CPU copy of the weights (rank 0 gets it; other ranks help gather);
- `optimizer_state` / `restore`: full optimiser state for checkpoints, and loading both back;
- `share(rows)` / `total(stats, grad_norm, device)`: the rows of a micro-batch this rank computes, and a
  step's summed stats and gradient norm over all ranks (policy.grpo_update);
- `trainable_state(model)`: a full CPU copy of the trained parameters only (a LoRA adapter's versions);
- `generating(model)` / `gather(items)`: generation where each rank samples its own prompts (held-out
  evaluation, evaluate.py), and every rank's results brought together.

On CUDA a rank's GPU is `cuda:LOCAL_RANK` of the GPUs its process sees: the learner host gives the
group exactly the GPUs of its slots (CUDA_VISIBLE_DEVICES, launch.py), so rank r runs on the r-th of them.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

FULL_ON_CPU: dict[str, Any] = {"full_state_dict": True, "cpu_offload": True}


class Solo:
    rank, size = 0, 1

    def device(self, wanted: str) -> torch.device:
        return torch.device(wanted)

    def announce(self, command: str, payload: Any = None) -> None:
        """Nothing to tell: there are no other ranks."""

    def wrap(self, model: Any, dtype: torch.dtype = torch.float32) -> Any:
        return model

    def model_state(self, model: Any) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def optimizer_state(self, model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def restore(self, model: Any, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
                optim: dict[str, Any]) -> None:
        model.load_state_dict(weights, strict=False)  # tied weights are stored twice; either copy loads
        optimizer.load_state_dict(optim)

    def close(self) -> None:
        """Nothing to release."""

    def share(self, rows: list[int]) -> list[int]:
        return rows

    def total(self, stats: dict[str, float], grad_norm: torch.Tensor, device: torch.device
              ) -> tuple[dict[str, float], float]:
        return stats, float(grad_norm)

    def trainable_state(self, model: Any) -> dict[str, torch.Tensor]:
        return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}

    @contextmanager
    def generating(self, model: Any) -> Iterator[Any]:
        yield model

    def gather(self, items: list[Any]) -> list[Any]:
        return items


class Sharded(Solo):
    """One rank of an FSDP group. Construct it in each torchrun process (it joins the group)."""

    def __init__(self, local_rank: int) -> None:
        import torch.distributed as dist

        # NCCL for CUDA tensors, gloo for CPU ones; CPU-only machines run the same code on gloo.
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
        self.rank, self.size, self.local_rank = dist.get_rank(), dist.get_world_size(), local_rank
        # Followers wait here while rank 0 waits for rollouts, which may take longer than the
        # default 30-minute collective timeout; a dead rank still ends the group (torchrun).
        self._control = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=7))

    def device(self, wanted: str) -> torch.device:
        if wanted != "cpu" and torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank)
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def announce(self, command: str, payload: Any = None) -> None:
        if self.rank == 0:
            self._broadcast((command, payload))

    def receive(self) -> tuple[str, Any]:
        """The next command from rank 0 (followers only)."""
        return self._broadcast(None)

    def _broadcast(self, message: Any) -> Any:
        import torch.distributed as dist

        box = [message]
        dist.broadcast_object_list(box, src=0, group=self._control)
        return box[0]

    def wrap(self, model: Any, dtype: torch.dtype = torch.float32) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # Gradients are reduced in float32 whatever the compute dtype: they update float32 masters.
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        layers = set(getattr(model, "_no_split_modules", None) or [])  # HF names its decoder layer class
        for module in model.modules():
            if type(module).__name__ in layers:
                fully_shard(module, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model

    def model_state(self, model: Any) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        self.announce("model_state")
        return get_model_state_dict(model, options=StateDictOptions(**FULL_ON_CPU))

    def optimizer_state(self, model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        self.announce("optimizer_state")
        return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(**FULL_ON_CPU))

    def restore(self, model: Any, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
                optim: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        full = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, weights, options=full)
        set_optimizer_state_dict(model, optimizer, optim, options=full)

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()

    def trainable_state(self, model: Any) -> dict[str, torch.Tensor]:
        """Every rank takes part in gathering each trained parameter (in one order); each gets the copy."""
        self.announce("trainable_state")
        return {n: _full(p).to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}

    @contextmanager
    def generating(self, model: Any) -> Iterator[Any]:
        """The sharded model for generation: each forward pass gathers every layer from all ranks, so all
        ranks must make the same number of them, yet each samples its own prompts and stops when they are
        done. So ranks agree before every pass (`Lockstep`), and a rank done early makes one-token passes
        until all are done."""
        stepper = Lockstep(model, self._control)
        try:
            yield stepper
        finally:
            stepper.drain()

    def gather(self, items: list[Any]) -> list[Any]:
        """Every rank's items, rank 0's first (all ranks call it)."""
        import torch.distributed as dist

        out: list[list[Any] | None] = [None] * self.size
        dist.all_gather_object(out, items, group=self._control)
        return [item for part in out for item in part or []]

    def share(self, rows: list[int]) -> list[int]:
        """Every size-th row, from this rank's."""
        return rows[self.rank::self.size]

    def total(self, stats: dict[str, float], grad_norm: torch.Tensor, device: torch.device
              ) -> tuple[dict[str, float], float]:
        import torch.distributed as dist

        keys = sorted(stats)  # the same keys on every rank (policy._Pass fills them all)
        summed = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(summed)
        return dict(zip(keys, summed.tolist(), strict=True)), float(grad_norm.full_tensor())


class Lockstep:
    """A sharded model that makes forward passes in rounds with the other ranks (Sharded.generating). Before
    each pass every rank says whether it still generates (an all-reduce on the control group); while any
    does, all pass, those done on a one-token dummy input."""

    def __init__(self, model: Any, group: Any) -> None:
        self.model, self.group = model, group
        self.device = next(model.parameters()).device

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._round(generating=True)
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # parameters(), config, ... of the model it wraps
        return getattr(self.model, name)

    @torch.no_grad()
    def drain(self) -> None:
        """Pass with the ranks still generating until none is (no graph kept: nothing trains on these)."""
        dummy = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        while self._round(generating=False):
            self.model(input_ids=dummy, use_cache=False)

    def _round(self, generating: bool) -> bool:
        """Whether any rank generates this round."""
        import torch.distributed as dist

        flag = torch.tensor([int(generating)])
        dist.all_reduce(flag, group=self.group)
        return bool(flag.item())


def _full(param: Any) -> torch.Tensor:
    """The whole tensor of a parameter FSDP shards (a DTensor), the tensor itself otherwise."""
    full = getattr(param, "full_tensor", None)
    return (full() if full is not None else param).detach()
