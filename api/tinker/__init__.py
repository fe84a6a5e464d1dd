"""A Tinker-compatible HTTP surface: the official `tinker` SDK, pointed at Echo2 with TINKER_BASE_URL,
trains LoRA adapters on a Tinker learner host and samples from them (docs/TINKER.md)."""

from fastapi import APIRouter

from . import billing, checkpoints, futures, host, sampling, sequences, sessions, states, training, unsupported

router = APIRouter()
for module in (sessions, training, sampling, futures, host, states, checkpoints, billing, sequences,
               unsupported):  # unsupported answers every other /api/v1 path: last
    router.include_router(module.router)

__all__ = ["router"]
