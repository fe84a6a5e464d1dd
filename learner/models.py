"""Where a job's base model comes from: a built-in (`echo2:tiny`, `echo2:smollm2`), a local folder, or
a hub id (only when the learner host is online). Built-ins are built once into a cache folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from echo2.protocol import JobSpec, WeightDtype

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


def published_dtype(spec: JobSpec, model_path: str) -> Any:
    """The torch dtype versions are published in: the job's choice, or (`auto`) the base model's own as its
    config states it (bfloat16 for most released models), float32 when it states none."""
    import torch

    if spec.weights.dtype is not WeightDtype.auto:
        return getattr(torch, spec.weights.dtype.value)
    from transformers import AutoConfig

    stated = getattr(AutoConfig.from_pretrained(model_path), "dtype", None)
    if isinstance(stated, str):
        stated = getattr(torch, stated, None)
    return stated if stated in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def cast(state: dict[str, Any], dtype: Any) -> dict[str, Any]:
    """The weights in the published dtype (floating tensors only; a no-op copy-free for float32)."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
