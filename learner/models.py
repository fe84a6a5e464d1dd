"""Where a job's base model comes from: a built-in (`echo2:tiny`, `echo2:smollm2`), a local folder, or
a hub id (only when the learner host is online). Built-ins are built once into a cache folder. Which names
are valid, and why a folder is refused, is the SDK's `echo2.models` (the control plane checks them too).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from echo2.loading import LOAD_LOCK
from echo2.models import BUILTINS, private_dir_of, private_model_error
from echo2.protocol import LoraConfig


def resolve_model(ref: str, cache_dir: Path, seed: int = 0, private: tuple[Path, ...] = ()) -> str:
    """A path (or hub id) that `from_pretrained` can load; a local folder inside `private` (the caller's work
    dir) or ECHO2_DATA_DIR is refused."""
    if ref == "echo2:tiny":
        from .tiny import build_tiny_model

        target = cache_dir / f"tiny-seed{seed}"
        if not (target / "config.json").exists():
            build_tiny_model(target, seed=seed)
        return str(target)
    if ref == "echo2:smollm2":
        from .tiny import import_smollm2

        target = cache_dir / "smollm2-135m-instruct"
        if not (target / "config.json").exists():
            import_smollm2(target)
        return str(target)
    if ref.startswith("echo2:"):
        raise ValueError(f"unknown built-in model {ref!r}; built-ins are {', '.join(BUILTINS)}")
    local = Path(ref).expanduser()
    if not local.exists():
        return ref  # a hub id
    inside = private_dir_of(ref, (*private, Path(os.environ.get("ECHO2_DATA_DIR") or ".echo2")))
    if inside is not None:
        raise ValueError(private_model_error(ref, inside))
    return str(local.resolve())


def with_adapter(model: Any, lora: LoraConfig) -> Any:
    """The model wrapped with a fresh LoRA adapter (peft): only the adapter trains, and it starts at zero,
    so the wrapped model computes what the base does."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                            target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM")
    try:
        with LOAD_LOCK:  # peft builds the adapter's modules: not while another thread builds a model
            return get_peft_model(model, config)
    except ValueError as exc:  # e.g. a target module the architecture does not have
        raise ValueError(f"lora.target_modules {lora.target_modules} do not fit this model: {exc}") from exc
