"""Where a job's base model comes from: a built-in (`echo2:tiny`, `echo2:smollm2`), a local folder, or
a hub id (only when the learner host is online). Built-ins are built once into a cache folder.

A local folder may not be inside Echo2's own data on the host: a learner's or Tinker host's work dir and
ECHO2_DATA_DIR hold other users' checkpoints, published versions and saved states, and a job or a Tinker
model naming one of those as its base model would hand it over.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from echo2.protocol import LoraConfig

BUILTINS = ("echo2:tiny", "echo2:smollm2")


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


HUB_TIMEOUT_S = 10.0
OPTIONS = "a built-in (echo2:tiny, echo2:smollm2), a model folder on the learner host, or a Hugging Face id"


def model_error(ref: str, hub_cache: Path | None = None, look: bool = True) -> str | None:
    """Why the learner host could not load `ref`, said so that its owner can fix it, or None: an unknown
    built-in, a path that is no model folder, a Hub id that is malformed or, where the Hub cannot be reached
    (offline, or no network), not in the Hugging Face cache. Checked at submission, so that a job that cannot
    load its model is refused at once instead of failing after its learner's launches. `look` False: only
    built-in names (the caller does not see the learner host's disks)."""
    if ref.startswith("echo2:"):
        return None if ref in BUILTINS else f"unknown built-in model {ref!r}: built-ins are {', '.join(BUILTINS)}"
    if not look:
        return None
    local = Path(ref).expanduser()
    if local.exists() or ref.startswith(("/", "~", ".")):
        if not local.is_dir():
            return f"{ref}: no such folder on the learner host; give {OPTIONS}"
        if not (local / "config.json").is_file():
            return f"{ref} has no config.json: not a Hugging Face model folder"
        return None
    return _hub_error(ref, hub_cache)


def _hub_error(ref: str, hub_cache: Path | None) -> str | None:
    import huggingface_hub
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(ref)
    except HFValidationError:
        return (f"{ref!r} is neither a folder on the learner host nor a Hugging Face id (name or org/name); "
                f"give {OPTIONS}")
    if isinstance(huggingface_hub.try_to_load_from_cache(ref, "config.json", cache_dir=hub_cache), str):
        return None
    cache = hub_cache or huggingface_hub.constants.HF_HUB_CACHE
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return (f"{ref} is not in the learner host's Hugging Face cache ({cache}) and the host is offline "
                "(HF_HUB_OFFLINE): download it there first (hf download ID) or give a model folder")
    try:
        huggingface_hub.model_info(ref, timeout=HUB_TIMEOUT_S)
    except RepositoryNotFoundError:
        return f"{ref}: no such model on the Hugging Face Hub (or it is private or gated)"
    except Exception as exc:  # no network, DNS, a proxy: the host cannot fetch it either
        return (f"{ref} is not in the learner host's Hugging Face cache ({cache}) and the Hub cannot be reached "
                f"({type(exc).__name__}: {exc}): download it there first (hf download ID) or give a model folder")
    return None


def private_dir_of(ref: str, private: tuple[Path, ...]) -> Path | None:
    """The one of `private` that the local folder `ref` is inside (links followed), if any."""
    local = Path(ref).expanduser()
    if not local.exists():
        return None
    real = local.resolve()
    return next((d for d in private if real.is_relative_to(d.resolve())), None)


def private_model_error(ref: str, private: Path) -> str:
    return (f"{ref} is inside Echo2's own data on this host ({private}), where other jobs' checkpoints and "
            "weights are kept: give a model folder outside it")


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
