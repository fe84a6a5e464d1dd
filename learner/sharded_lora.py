"""A LoRA job's versions when its model is sharded over ranks (FSDP, learner.gpus > 1).

`LoraWeights` (weights.py) reads the trained peft model itself: its adapter's tensors for each version,
its base for version 0, the adapter merged into a copy of it for the final one. Sharded, each rank holds
only a slice of every tensor, and the publisher writes from its own thread, where no collective may run.
So here a snapshot gathers the adapter from all ranks (parallel.Sharded.trainable_state, announced so the
other ranks take part), and versions are written from an unsharded copy of the base on the CPU, wrapped
with the same adapter configuration: the base never trains under LoRA, so that copy is the base as the
ranks hold it, and the adapter written or merged is the one gathered. The copy is loaded (float32, like
the learner's) the first time rank 0 writes a version; the other ranks never write.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from echo2.loading import load_causal_lm
from echo2.protocol import LoraConfig

from .models import with_adapter
from .parallel import Solo
from .weights import LoraWeights, cast


class ShardedLoraWeights(LoraWeights):
    def __init__(self, model: Any, tokenizer: Any, dtype: torch.dtype, world: Solo, model_path: str,
                 lora: LoraConfig) -> None:
        super().__init__(model, tokenizer, dtype, world)
        self.trained, self.model_path, self.lora_config = model, model_path, lora
        self._twin: Any = None
        self._loading = threading.Lock()

    def snapshot(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        full = self.world.trainable_state(self.trained)
        state = get_peft_model_state_dict(self.trained, state_dict=full, save_embedding_layers=False)
        return cast(dict(state), self.dtype)

    def write(self, state: dict[str, torch.Tensor], folder: Any, role: Any) -> None:
        self.model = self._unsharded()  # LoraWeights.write reads `self.model`: the CPU copy
        super().write(state, folder, role)

    def _unsharded(self) -> Any:
        with self._loading:
            if self._twin is None:
                base = load_causal_lm(self.model_path, dtype=torch.float32, use_safetensors=True)
                self._twin = with_adapter(base, self.lora_config).eval()
            return self._twin
