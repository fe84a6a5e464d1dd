"""Where a job's base model comes from: a built-in (`echo2:tiny`, `echo2:smollm2`), a local folder, or
a hub id (only when the learner host is online). Built-ins are built once into a cache folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from echo2.protocol import LoraConfig

BUILTINS = ("echo2:tiny", "echo2:smollm2")


def resolve_model(ref: str, cache_dir: Path, seed: int = 0) -> str:
    """A path (or hub id) that `from_pretrained` can load."""
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
    return str(Path(ref).expanduser()) if Path(ref).expanduser().exists() else ref



def with_adapter(model: Any, lora: LoraConfig) -> Any:
    """The model wrapped with a fresh LoRA adapter (peft): only the adapter trains, and it starts at zero,
    so the wrapped model computes what the base does."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                            target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as exc:  # e.g. a target module the architecture does not have
        raise ValueError(f"lora.target_modules {lora.target_modules} do not fit this model: {exc}") from exc
