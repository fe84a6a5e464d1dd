"""Datasets: prompt items a user uploads once and reuses across jobs."""

from __future__ import annotations

import json
from typing import Annotated, Any

from echo2.protocol import DatasetCreate, DatasetItems, DatasetRead, Page
from echo2.protocol.datasets import Item
from fastapi import APIRouter, File, Form, Query, UploadFile
from pydantic import TypeAdapter, ValidationError
from sqlalchemy import delete, func, insert, select

from ..deps import CurrentUser, SessionDep
from ..errors import ApiError
from ..models import Dataset, DatasetItem, User

router = APIRouter(prefix="/v1", tags=["datasets"])
_item = TypeAdapter(Item)
MAX_ITEMS = 100_000


@router.post("/datasets", status_code=201, operation_id="create_dataset", summary="Create a dataset from JSON items")
def create_dataset(body: DatasetCreate, user: CurrentUser, db: SessionDep) -> DatasetRead:
    dataset = _store(db, user, body.name, body.items)
    db.commit()
    return _read(dataset)


@router.post("/datasets/upload", status_code=201, operation_id="upload_dataset",
             summary="Create a dataset from an uploaded JSONL file (one JSON object per line)")
def upload_dataset(user: CurrentUser, db: SessionDep,
                   file: Annotated[UploadFile, File(description="JSONL: one JSON object per line.")],
                   name: Annotated[str, Form(min_length=1, max_length=128, pattern=r"^[^\x00]+$")]) -> DatasetRead:
    items = _parse_jsonl(file)
    dataset = _store(db, user, name, items)
    db.commit()
    return _read(dataset)


@router.get("/datasets", operation_id="list_datasets", summary="List your datasets")
def list_datasets(user: CurrentUser, db: SessionDep, limit: Annotated[int, Query(ge=1, le=200)] = 50,
                  offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0) -> Page[DatasetRead]:
    query = select(Dataset).where(Dataset.owner_id == user.id)
    total = db.scalar(select(func.count()).select_from(query.subquery())) or 0
    items = [_read(d) for d in db.scalars(query.order_by(Dataset.created_at.desc()).limit(limit).offset(offset))]
    nxt = offset + len(items) if offset + len(items) < total else None
    return Page[DatasetRead](items=items, total=total, next_offset=nxt)


@router.get("/datasets/{dataset_id}", operation_id="get_dataset", summary="Get a dataset's metadata")
def get_dataset(dataset_id: str, user: CurrentUser, db: SessionDep) -> DatasetRead:
    return _read(_owned(db, user, dataset_id))


@router.get("/datasets/{dataset_id}/items", operation_id="list_dataset_items", summary="Read a dataset's items")
def list_items(dataset_id: str, user: CurrentUser, db: SessionDep,
               limit: Annotated[int, Query(ge=1, le=1000)] = 100,
               offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0) -> DatasetItems:
    dataset = _owned(db, user, dataset_id)
    rows = list(db.scalars(select(DatasetItem.data).where(DatasetItem.dataset_id == dataset.id)
                           .order_by(DatasetItem.index).limit(limit).offset(offset)))
    nxt = offset + len(rows) if offset + len(rows) < dataset.num_items else None
    return DatasetItems(items=rows, total=dataset.num_items, next_offset=nxt)


@router.delete("/datasets/{dataset_id}", status_code=204, operation_id="delete_dataset", summary="Delete a dataset")
def delete_dataset(dataset_id: str, user: CurrentUser, db: SessionDep) -> None:
    dataset = _owned(db, user, dataset_id)
    db.execute(delete(DatasetItem).where(DatasetItem.dataset_id == dataset.id))
    db.delete(dataset)
    db.commit()


def _owned(db: SessionDep, user: User, dataset_id: str) -> Dataset:
    dataset = db.get(Dataset, dataset_id)
    if dataset is None or (dataset.owner_id != user.id and user.role != "admin"):
        raise ApiError(404, f"dataset {dataset_id} not found")
    return dataset


def _parse_jsonl(file: UploadFile) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for lineno, raw in enumerate(file.file, start=1):
        line = raw.strip()
        if not line:
            continue
        if len(items) >= MAX_ITEMS:
            raise ApiError(422, f"more than {MAX_ITEMS} items", field="file")
        try:
            items.append(_item.validate_python(json.loads(line)))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(422, f"line {lineno}: not valid JSON ({exc})", field="file") from None
        except ValidationError as exc:
            err = exc.errors()[0]
            raise ApiError(422, f"line {lineno}: {err['msg']} at {err['loc']}", field="file") from None
    if not items:
        raise ApiError(422, "the file has no items", field="file")
    return items


def _store(db: SessionDep, user: User, name: str, items: list[dict[str, Any]]) -> Dataset:
    keys = sorted({k for item in items for k in item})[:64]
    dataset = Dataset(owner_id=user.id, name=name, num_items=len(items), keys=keys)
    db.add(dataset)
    db.flush()
    db.execute(insert(DatasetItem), [{"dataset_id": dataset.id, "index": i, "data": it} for i, it in enumerate(items)])
    return dataset


def _read(d: Dataset) -> DatasetRead:
    return DatasetRead.model_validate(d)
