"""Generation backends behind one small interface (base.GenerationBackend).

Importing this package never imports torch or vllm: the implementations import them lazily so
that `echo2-worker --help` stays fast. Use `create_backend("transformers" | "vllm")`.
"""

from __future__ import annotations

from typing import Any

from echo2_worker.backends.base import (
    BackendError,
    FinishReason,
    GenerationBackend,
    GenRequest,
    GenSample,
    model_eos_token_ids,
    safetensors_files,
)

BACKEND_NAMES = ("transformers", "vllm")


def create_backend(name: str, **options: Any) -> GenerationBackend:
    """Instantiate a backend by name; options go to its constructor (e.g. device="cpu")."""
    if name == "transformers":
        from echo2_worker.backends.transformers_backend import TransformersBackend

        return TransformersBackend(**options)
    if name == "vllm":
        from echo2_worker.backends.vllm_backend import VLLMBackend

        return VLLMBackend(**options)
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")


__all__ = [
    "BACKEND_NAMES",
    "BackendError",
    "FinishReason",
    "GenRequest",
    "GenSample",
    "GenerationBackend",
    "create_backend",
    "model_eos_token_ids",
    "safetensors_files",
]
