"""A Tinker-compatible HTTP surface: the official `tinker` SDK, pointed at Echo2 with TINKER_BASE_URL,
trains LoRA adapters on a Tinker learner host and samples from them (docs/TINKER.md)."""

from ..routing import make_router
from . import billing, checkpoints, futures, host, sampling, sequences, sessions, states, training, unsupported

router = make_router()
for module in (sessions, training, sampling, futures, host, states, checkpoints, billing, sequences,
               unsupported):  # unsupported answers every other /api/v1 path: last
    router.include_router(module.router)

__all__ = ["router"]
