"""Datasets: a user's prompt items (JSON, or JSONL uploaded in resumable parts), referenced by jobs.

An item is a flat object whose keys the job's task reads (e.g. `prompt`/`reference`, `question`/`answer`), or a
chat item: `messages`, a list of {role, content} turns (system, user, assistant) ending with a user turn,
rendered by the model's chat template; its last user turn is the task's prompt."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError, WithJsonSchema

from .common import Finite, Key, Model, Name, ReadModel, Sha256, Text, reason

MESSAGES = "messages"  # the key of a chat item's turns


class ChatRole(StrEnum):
    system = "system"
    user = "user"
    assistant = "assistant"


class ChatTurn(Model):
    role: ChatRole
    content: Text


Scalar = Annotated[Text | bool | int | float | None, Finite]  # bool before int: true stays true
MAX_TURNS = 64
_scalar: TypeAdapter[object] = TypeAdapter(Scalar)
_turns: TypeAdapter[list[ChatTurn]] = TypeAdapter(Annotated[list[ChatTurn], Field(max_length=MAX_TURNS)])


def _value(value: object) -> object:
    """A scalar, or a chat item's turns; an error names the key alone (a union would name its branches)."""
    adapter: TypeAdapter[Any] = _turns if isinstance(value, list) else _scalar
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "nullable")))
        raise ValueError(f"{where}: {reason(err)}" if where and isinstance(value, list) else reason(err)) from None


_VALUE_SCHEMA = {"anyOf": [{"type": "string", "maxLength": 32_768}, {"type": "boolean"}, {"type": "number"},
                           {"type": "null"}, {"type": "array", "maxItems": MAX_TURNS, "items": {
                               "type": "object", "required": ["role", "content"], "additionalProperties": False,
                               "properties": {"role": {"enum": [r.value for r in ChatRole]},
                                              "content": {"type": "string", "maxLength": 32_768}}}}]}
Value = Annotated[Any, BeforeValidator(_value), WithJsonSchema(_VALUE_SCHEMA)]


def _lists_only_in_messages(item: object) -> object:
    if isinstance(item, dict):
        for key, value in item.items():
            if isinstance(value, list) and key != MESSAGES:
                raise ValueError(f"key {key!r} holds a list; only {MESSAGES!r} may (a chat item's turns)")
    return item


Item = Annotated[dict[Key, Value], BeforeValidator(_lists_only_in_messages)]


class DatasetCreate(Model):
    name: Name
    items: list[Annotated[Item, Field(max_length=16)]] = Field(min_length=1, max_length=100_000)


class DatasetRead(ReadModel):
    id: str
    name: str
    num_items: int
    keys: list[str] = Field(description="Keys seen in the items, e.g. `question`, `answer`, `messages`.")
    created_at: datetime


class DatasetItems(ReadModel):
    items: list[Item]
    total: int
    next_offset: int | None = None


class UploadCreate(Model):
    """Start (or resume) the upload of a JSONL file of `size` bytes in parts: the same name, size and sha256
    from the same user resume the upload already begun."""

    name: Name
    size: int = Field(ge=1, le=2**40, description="The file's size in bytes.")
    sha256: Sha256 = Field(description="The whole file's sha256, checked when the upload completes.")


class UploadRead(ReadModel):
    id: str
    name: str
    size: int
    sha256: str
    part_size: int = Field(description="Every part but the last has exactly this many bytes.")
    parts: int = Field(description="How many parts the file is cut into.")
    received: list[int] = Field(description="The parts the control plane holds (send the others).")
    created_at: datetime


def item_problem(item: dict[str, object]) -> str | None:
    """Why an item is not a valid dataset item beyond its types, or None: turns only under `messages`, and a
    chat item's turns end with the user's (the prompt the model answers)."""
    for key, value in item.items():
        if isinstance(value, list) and key != MESSAGES:
            return f"key {key!r} holds a list; only {MESSAGES!r} may (a chat item's turns)"
    turns = item.get(MESSAGES)
    if isinstance(turns, list):
        if not turns:
            return f"{MESSAGES!r} is empty: give at least one user turn"
        last = turns[-1]
        role = last.role if isinstance(last, ChatTurn) else (last.get("role") if isinstance(last, dict) else None)
        if role != ChatRole.user:
            said = getattr(role, "value", role)  # an enum's value, not its repr
            return f"{MESSAGES!r} must end with a user turn (the prompt the model answers), not {said!r}"
    return None
