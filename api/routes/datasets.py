"""Datasets: prompt items a user uploads once and reuses across jobs: as JSON, as a JSONL file in one request,
or as a JSONL file of any size in resumable parts (api/services/uploads.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from echo2.protocol import DatasetCreate, DatasetItems, DatasetRead, Page, UploadCreate, UploadRead
from echo2.protocol.datasets import item_problem
from fastapi import Body, File, Form, Header, Path, Query, UploadFile
from sqlalchemy import delete, func, select

from ..deps import CurrentUser, SessionDep, SettingsDep
from ..errors import ApiError
from ..models import Dataset, DatasetItem, DatasetUpload, User
from ..routing import make_router
from ..services import uploads

router = make_router(prefix="/v1", tags=["datasets"])
UploadPath = Annotated[str, Path(max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")]


@router.post("/datasets", status_code=201, operation_id="create_dataset", summary="Create a dataset from JSON items")
def create_dataset(body: DatasetCreate, user: CurrentUser, db: SessionDep) -> DatasetRead:
    for i, item in enumerate(body.items):
        if problem := item_problem(item):
            raise ApiError(422, f"items.{i}: {problem}", field=f"items.{i}")
    items = [{k: [t.model_dump(mode="json") for t in v] if isinstance(v, list) else v for k, v in item.items()}
             for item in body.items]
    dataset = uploads.store(db, user, body.name, items)
    db.commit()
    return _read(dataset)


@router.post("/datasets/upload", status_code=201, operation_id="upload_dataset",
             summary="Create a dataset from an uploaded JSONL file (one JSON object per line) of at most "
                     "ECHO2_MAX_BODY_BYTES; every bad line is named with its number",
             description="Larger files go in parts: POST /v1/datasets/uploads.")
def upload_dataset(user: CurrentUser, db: SessionDep,
                   file: Annotated[UploadFile, File(description="JSONL: one JSON object per line.")],
                   name: Annotated[str, Form(min_length=1, max_length=128, pattern=r"^[^\x00]+$")]) -> DatasetRead:
    items = uploads.parse(_read_blocks(file))
    dataset = uploads.store(db, user, name, items)
    db.commit()
    return _read(dataset)


def _read_blocks(file: UploadFile) -> Iterator[bytes]:
    while block := file.file.read(1 << 20):
        yield block


@router.post("/datasets/uploads", operation_id="start_dataset_upload",
             summary="Start the upload of a JSONL file of any size in parts, or resume it (the same name, size and "
                     "sha256): the answer lists the parts already received",
             responses={409: {"description": "This file was uploaded under this name already: the detail names "
                                             "its dataset."},
                        413: {"description": "Your uploads in progress would declare more than ECHO2_MAX_UPLOAD_BYTES "
                                             "together: complete or abandon one first."}})
def start_upload(body: UploadCreate, user: CurrentUser, db: SessionDep, settings: SettingsDep) -> UploadRead:
    upload = uploads.start(db, user, settings, body)
    db.commit()
    return uploads.read(settings, upload)


@router.get("/datasets/uploads/{upload_id}", operation_id="get_dataset_upload",
            summary="An upload in progress: which parts the control plane holds")
def get_upload(upload_id: UploadPath, user: CurrentUser, db: SessionDep, settings: SettingsDep) -> UploadRead:
    return uploads.read(settings, _upload(db, user, upload_id))


@router.put("/datasets/uploads/{upload_id}/parts/{index}", status_code=204, operation_id="put_dataset_upload_part",
            summary="Send one part (part_size bytes, the last one the rest); its sha256 must match; a repeat "
                    "replaces it")
def put_part(upload_id: UploadPath, index: Annotated[int, Path(ge=0, le=1_000_000)], user: CurrentUser,
             db: SessionDep, settings: SettingsDep,
             body: Annotated[bytes, Body(media_type="application/octet-stream")],
             sha256: Annotated[str, Header(alias="X-Echo2-Sha256", pattern=r"^[0-9a-f]{64}$")]) -> None:
    upload = _upload(db, user, upload_id)
    db.commit()  # no transaction held while the part is written
    uploads.put_part(settings, upload, index, body, sha256)


@router.post("/datasets/uploads/{upload_id}/complete", status_code=201, operation_id="complete_dataset_upload",
             summary="Check the whole file against its sha256, parse it (every bad line named with its number) and "
                     "create the dataset",
             description="A file refused here (422) is dropped with its parts: its sha256 allows no other content, "
                         "so fix the file and upload it again (POST /v1/datasets/uploads).",
             responses={409: {"description": "Parts are missing: send them, then complete again."},
                        422: {"description": "The file is refused (bad lines, sha256, size); the upload is gone."}})
def complete_upload(upload_id: UploadPath, user: CurrentUser, db: SessionDep, settings: SettingsDep) -> DatasetRead:
    return _read(uploads.complete(db, user, settings, _upload(db, user, upload_id, for_update=True)))


@router.delete("/datasets/uploads/{upload_id}", status_code=204, operation_id="abandon_dataset_upload",
               summary="Abandon an upload and drop the parts received")
def abandon_upload(upload_id: UploadPath, user: CurrentUser, db: SessionDep, settings: SettingsDep) -> None:
    uploads.abandon(db, settings, _upload(db, user, upload_id))


def _upload(db: SessionDep, user: User, upload_id: str, for_update: bool = False) -> DatasetUpload:
    upload = db.get(DatasetUpload, upload_id, with_for_update=for_update)
    if upload is None or upload.owner_id != user.id:
        raise ApiError(404, f"upload {upload_id} not found")
    return upload


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


def _read(d: Dataset) -> DatasetRead:
    return DatasetRead.model_validate(d)
