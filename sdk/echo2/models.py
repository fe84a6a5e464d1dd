"""The base models a job may name, checked without torch: a built-in (`echo2:tiny`, `echo2:smollm2`), a model
folder on the learner host, or a Hugging Face id. The control plane checks a job's model with these at
submission (api/services/jobs.py) and estimates its memory from the built-ins' shapes (api/services/memory.py);
the learner resolves and builds them (learner/models.py, learner/tiny.py). The Hub check imports
huggingface_hub, which the control plane and the learner have (transformers brings it); the SDK itself does
not need it.

A local folder may not be inside Echo2's own data on the host: a learner's or Tinker host's work dir and
ECHO2_DATA_DIR hold other users' checkpoints, published versions and saved states, and a job or a Tinker
model naming one of those as its base model would hand it over.
"""

from __future__ import annotations

from pathlib import Path

BUILTINS = ("echo2:tiny", "echo2:smollm2")

# The tiny model's architecture (learner/tiny.py builds it): head_dim = hidden_size / num_attention_heads
# must stay >= 64 for vLLM on CPU.
TINY_CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
}
TINY_VOCAB_SIZE = 96  # base alphabet + specials + a few merges; small on purpose (learner/tiny.py says why)

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
