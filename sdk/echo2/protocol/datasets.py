"""Datasets: a user's prompt items (JSON or uploaded JSONL), referenced by jobs."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import Field

from .common import Finite, Key, Model, Name, ReadModel, Text

Item = dict[Key, Annotated[Text | bool | int | float | None, Finite]]  # bool before int: true stays true


class DatasetCreate(Model):
    name: Name
    items: list[Annotated[Item, Field(max_length=16)]] = Field(min_length=1, max_length=100_000)


class DatasetRead(ReadModel):
    id: str
    name: str
    num_items: int
    keys: list[str] = Field(description="Keys seen in the items, e.g. `question`, `answer`.")
    created_at: datetime


class DatasetItems(ReadModel):
    items: list[Item]
    total: int
    next_offset: int | None = None
