"""Name -> task adapter. Built-in tasks register themselves when `tasks` is imported."""

from __future__ import annotations

from tasks.base import TaskAdapter, TaskError

_TASKS: dict[str, TaskAdapter] = {}


class UnknownTaskError(TaskError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def register(adapter: TaskAdapter) -> TaskAdapter:
    """Make `adapter` available under `adapter.name`; re-registering the same class is a no-op."""
    name = getattr(adapter, "name", None)
    if not isinstance(name, str) or not name or len(name) > 64:
        raise TaskError("a task adapter needs a non-empty `name` of at most 64 characters")
    existing = _TASKS.get(name)
    if existing is not None and type(existing) is not type(adapter):
        raise TaskError(f"task name {name!r} is already registered by {type(existing).__name__}")
    _TASKS[name] = adapter
    return adapter


def get_task(name: str) -> TaskAdapter:
    try:
        return _TASKS[name]
    except KeyError:
        known = ", ".join(sorted(_TASKS)) or "none"
        raise UnknownTaskError(f"unknown task {name!r}; known tasks: {known}") from None


def list_tasks() -> list[str]:
    return sorted(_TASKS)
