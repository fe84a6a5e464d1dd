"""Task adapters (the data plane): prompt sources, verifiers, optional multi-turn environments.

Importable without torch. Importing this package registers the built-in tasks; a new task is a new
module that subclasses `TaskAdapter` and calls `register(...)`, plus one import line below.
"""

from learner.tasks import arithmetic, gsm8k, guess_number, http_env, http_reward, matching  # noqa: F401  (register)
from learner.tasks.base import (
    Episode,
    EpisodeResult,
    ScoringError,
    TaskAdapter,
    TaskError,
    TaskItemError,
    TaskParams,
    TaskParamsError,
    TaskPrompt,
    Turn,
    derive_seed,
    run_episode,
)
from learner.tasks.registry import UnknownTaskError, get_task, list_tasks, register

__all__ = [
    "Episode",
    "EpisodeResult",
    "ScoringError",
    "TaskAdapter",
    "TaskError",
    "TaskItemError",
    "TaskParams",
    "TaskParamsError",
    "TaskPrompt",
    "Turn",
    "UnknownTaskError",
    "derive_seed",
    "get_task",
    "list_tasks",
    "register",
    "run_episode",
]
