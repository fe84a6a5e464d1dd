"""What a job's versions carry, and how a version's folder is written.

- Full fine-tuning (`Weights`): every version is the model folder, in the published dtype
  (`published_dtype`: the job's choice, or the base model's own); the learner trains float32 master
  weights and keeps its optimiser state in float32 whatever is published, and computes on the masters
  rounded to the published dtype (learner/rounding.py: `Weights.computing`).
- LoRA (`LoraWeights`, JobSpec.lora, peft): the job's first version (0) is the base model; the adapter
  starts at zero, so that is the policy. Later versions are the adapter folder alone
  (`adapter_config.json` + `adapter_model.safetensors`), named in their manifest as applying to version 0,
  so workers fetch the base once. The final version is the merged model with the adapter beside it in
  `adapter/`: the checkpoint download is both.

A snapshot is what a version is made of: a CPU copy of the weights (the whole model, or the adapter's
tensors) in the published dtype, rounded as the learner computes on them, which the auditor also
re-scores rollouts under. It is cast on the model's device, so only the published bytes cross to the CPU.
"""

from __future__ import annotations

import copy
import shutil
from contextlib import AbstractContextManager, nullcontext
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from echo2.protocol import JobSpec, WeightDtype

from .parallel import Sharded, Solo
from .rounding import Rounder

ADAPTER_DIR = "adapter"  # where the final version of a LoRA job keeps its adapter


class Role(Enum):
    first = "first"  # the job's version 0
    next = "next"
    final = "final"


def published_dtype(spec: JobSpec, model_path: str) -> torch.dtype:
    """The dtype versions are published in: the job's choice, or (`auto`) the base model's own as its
    config states it (bfloat16 for most released models), float32 when it states none."""
    if spec.weights.dtype is not WeightDtype.auto:
        return getattr(torch, spec.weights.dtype.value)
    from transformers import AutoConfig

    stated = getattr(AutoConfig.from_pretrained(model_path), "dtype", None)
    if isinstance(stated, str):
        stated = getattr(torch, stated, None)
    return stated if stated in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def cast(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights in the published dtype (floating tensors only; copy-free for float32)."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def cpu_copy(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A CPU copy of `state` with its floating tensors in `dtype`, cast where they are (a GPU sends half the
    bytes of float32 for a bf16 version); always a copy, never a view of the model's own tensors."""
    out = {}
    for k, v in state.items():
        v = v.detach()
        t = v.to(dtype) if v.is_floating_point() else v
        out[k] = t.to("cpu", copy=t.data_ptr() == v.data_ptr())
    return out


class Weights:
    """A full fine-tune's versions: the model folder. `rounder` rounds the masters to what is published
    (learner/rounding.py); without one, nothing is rounded (a float32 job, or FSDP, whose gather casts)."""

    def __init__(self, model: Any, tokenizer: Any, dtype: torch.dtype, world: Solo | None = None,
                 rounder: Rounder | None = None) -> None:
        self.model, self.tokenizer, self.dtype, self.world = model, tokenizer, dtype, world or Solo()
        self.rounder = rounder

    @property
    def lora(self) -> bool:
        return False

    def computing(self) -> AbstractContextManager[None]:
        """Inside, the model computes on the published weights (its trainable parameters rounded)."""
        return self.rounder.computing() if self.rounder is not None else nullcontext()

    def snapshot(self) -> dict[str, torch.Tensor]:
        if isinstance(self.world, Sharded):  # rank 0 gathers float32 masters on the CPU; cast as FSDP's gather does
            return cast(self.world.model_state(self.model), self.dtype)
        with self.computing():
            return cpu_copy(self.model.state_dict(), self.dtype)

    def write(self, state: dict[str, torch.Tensor], folder: Path, role: Role) -> None:
        _fresh(folder)
        _save(self.model, state, folder)
        self.tokenizer.save_pretrained(folder)


def _save(model: Any, state: dict[str, torch.Tensor], folder: Path) -> None:
    """A copy of the dict: transformers 5 empties the one it is given for a model built in code, and the
    caller's (the snapshot) is also what the auditor keeps (learner/loop.py)."""
    model.save_pretrained(folder, state_dict=dict(state), safe_serialization=True)


class LoraWeights(Weights):
    """A LoRA job's versions (module docstring). `model` is the peft model being trained."""

    @property
    def lora(self) -> bool:
        return True

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The adapter's own tensors. Not peft's default, which with `lm_head` among the targets also saves the
        embedding matrix, untrained and already in the base: 113 MB more per version for SmolLM2."""
        from peft import get_peft_model_state_dict

        with self.computing():
            return cpu_copy(get_peft_model_state_dict(self.model, save_embedding_layers=False), self.dtype)

    def write(self, state: dict[str, torch.Tensor], folder: Path, role: Role) -> None:
        _fresh(folder)
        if role is Role.first:
            self._write_model(self._base_state(), folder)
            return
        if role is Role.final:
            self._write_model(self._merged_state(state), folder)
            folder = folder / ADAPTER_DIR
        self._write_adapter(state, folder)

    def _write_adapter(self, state: dict[str, torch.Tensor], folder: Path) -> None:
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        save_file(state, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        self.model.peft_config["default"].save_pretrained(folder)

    def _write_model(self, state: dict[str, torch.Tensor], folder: Path) -> None:
        _save(self.model.get_base_model(), state, folder)
        self.tokenizer.save_pretrained(folder)

    def _base_state(self) -> dict[str, torch.Tensor]:
        """The base model's weights under their own names (peft renames wrapped layers' to base_layer)."""
        state = self.model.get_base_model().state_dict()
        return cast({k.replace(".base_layer.", "."): v.detach().to("cpu", copy=True)
                     for k, v in state.items() if "lora_" not in k}, self.dtype)

    def _merged_state(self, adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The base with `adapter` folded in: what the final version serves as a plain model."""
        from peft import set_peft_model_state_dict

        twin = copy.deepcopy(self.model)
        set_peft_model_state_dict(twin, {k: v.float() for k, v in adapter.items()})
        merged = twin.merge_and_unload()
        return cast({k: v.detach().to("cpu", copy=True) for k, v in merged.state_dict().items()}, self.dtype)


def _fresh(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
