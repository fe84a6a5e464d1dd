"""Where a job's base model comes from: a built-in (`echo2:tiny`, `echo2:smollm2`), a local folder, or
a hub id (only when the learner host is online). Built-ins are built once into a cache folder."""

from __future__ import annotations

from pathlib import Path

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
