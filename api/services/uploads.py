"""Datasets of any size, uploaded as JSONL in parts: each part checked by its sha256 and kept on disk under
DATA_DIR/uploads/<id>/ as it arrives, so an interrupted upload resumes with the parts it lacks; on completion the
whole file is checked against its sha256, parsed line by line (every bad line named with its number), and stored
as a dataset in one transaction. A file refused on completion is dropped with its parts at once: its sha256, fixed
when the upload started, allows no other content, so only a new upload of the fixed file can succeed."""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import shutil
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from echo2.protocol import UploadCreate, UploadRead
from echo2.protocol.common import reason
from echo2.protocol.datasets import Item, item_problem
from pydantic import TypeAdapter, ValidationError
from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from ..errors import ApiError
from ..models import Dataset, DatasetItem, DatasetUpload, User
from ..settings import Settings

PART_SIZE = 8 * 2**20
MAX_ITEMS = 1_000_000
MAX_LINE_BYTES = 4 * 2**20
BAD_LINES_SHOWN = 50
INSERT_BATCH = 1000
_item = TypeAdapter(Item)


def folder(settings: Settings, upload_id: str) -> Path:
    return settings.data_dir / "uploads" / upload_id


def start(db: Session, user: User, settings: Settings, body: UploadCreate) -> DatasetUpload:
    """The upload of this file begun before by this user (resumed), or a new one; a 409 naming the dataset where
    this user's upload of the same file under the same name completed already (run again to resume, it made a
    second dataset of the same name)."""
    made = db.scalar(select(Dataset).where(Dataset.owner_id == user.id, Dataset.name == body.name,
                                           Dataset.sha256 == body.sha256).limit(1))
    if made is not None:
        raise ApiError(409, f"this file is dataset {made.id} already ({made.num_items} items, named {made.name!r}, "
                       f"uploaded {made.created_at:%Y-%m-%d %H:%M} UTC): use that id, or upload it under another "
                       "name", field="sha256")
    found = db.scalar(select(DatasetUpload).where(DatasetUpload.owner_id == user.id, DatasetUpload.name == body.name,
                                                  DatasetUpload.size == body.size,
                                                  DatasetUpload.sha256 == body.sha256))
    if found is not None:
        return found
    db.refresh(user, with_for_update=True)  # two starts at once count each other's bytes
    _check_room(db, user, settings, body.size)
    upload = DatasetUpload(owner_id=user.id, name=body.name, size=body.size, sha256=body.sha256, part_size=PART_SIZE)
    db.add(upload)
    db.flush()
    return upload


def _check_room(db: Session, user: User, settings: Settings, size: int) -> None:
    """A user's uploads in progress may declare at most ECHO2_MAX_UPLOAD_BYTES together: their parts fill the
    control plane's disk, which every tenant shares."""
    begun = int(db.scalar(select(func.coalesce(func.sum(DatasetUpload.size), 0))  # a Decimal on PostgreSQL
                          .where(DatasetUpload.owner_id == user.id)) or 0)
    if begun + size > settings.max_upload_bytes:
        raise ApiError(413, f"your uploads in progress declare {begun / 1e6:.2f} MB and this one {size / 1e6:.2f} MB, "
                       f"more than the {settings.max_upload_bytes / 1e6:.2f} MB one user may upload at once "
                       "(ECHO2_MAX_UPLOAD_BYTES): complete or abandon one first (DELETE "
                       "/v1/datasets/uploads/UPLOAD_ID)", field="size")


def read(settings: Settings, upload: DatasetUpload) -> UploadRead:
    return UploadRead(id=upload.id, name=upload.name, size=upload.size, sha256=upload.sha256,
                      part_size=upload.part_size, parts=_parts(upload), received=received(settings, upload),
                      created_at=upload.created_at)


def received(settings: Settings, upload: DatasetUpload) -> list[int]:
    where = folder(settings, upload.id)
    return sorted(int(p.stem) for p in where.glob("*.part")) if where.exists() else []


def _parts(upload: DatasetUpload) -> int:
    return math.ceil(upload.size / upload.part_size)


def put_part(settings: Settings, upload: DatasetUpload, index: int, data: bytes, sha256: str) -> None:
    """Keep part `index` (a repeat replaces it): its size and sha256 must be what they should."""
    parts = _parts(upload)
    if index >= parts:
        raise ApiError(422, f"the file has {parts} parts (0 to {parts - 1}); there is no part {index}", field="index")
    want = upload.part_size if index < parts - 1 else upload.size - upload.part_size * (parts - 1)
    if len(data) != want:
        raise ApiError(422, f"part {index} must have {want} bytes, not {len(data)}", field="body")
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ApiError(422, f"part {index} does not match its sha256: resend it", field="X-Echo2-Sha256")
    where = folder(settings, upload.id)
    where.mkdir(parents=True, exist_ok=True)
    partial = where / f"{index}.{secrets.token_hex(4)}.tmp"  # a copy of its own: a retry may race its first try
    with partial.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, where / f"{index}.part")


def complete(db: Session, user: User, settings: Settings, upload: DatasetUpload) -> Dataset:
    """Check the whole file, parse it, store the dataset and commit, then remove the parts: a failed commit (or a
    process killed before it) leaves the upload with all its parts, to complete again. A file refused for its
    content is abandoned (module docstring) before the refusal is raised."""
    missing = sorted(set(range(_parts(upload))) - set(received(settings, upload)))
    if missing:
        raise ApiError(409, f"{len(missing)} parts are missing (first: {missing[:10]}): send them, then complete",
                       field="parts")
    try:
        items = parse(_blocks(settings, upload), upload.sha256)
    except ApiError:
        abandon(db, settings, upload)
        raise
    dataset = store(db, user, upload.name, items, upload.sha256)
    upload_id = upload.id
    db.delete(upload)
    db.commit()
    shutil.rmtree(folder(settings, upload_id), ignore_errors=True)
    return dataset


def drop_stale(db: Session, settings: Settings, before: datetime) -> int:
    """Abandon the uploads started before `before` that have received no part since; returns how many. An
    interrupted upload resumes until then (the retention sweep's ECHO2_ARCHIVE_AFTER_H); after it, nothing would
    ever remove its parts."""
    gone = 0
    for upload in db.scalars(select(DatasetUpload).where(DatasetUpload.created_at <= before)).all():
        parts = [p.stat().st_mtime for p in folder(settings, upload.id).glob("*.part")]
        if max(parts, default=0.0) <= before.timestamp():
            abandon(db, settings, upload)
            gone += 1
    return gone


def abandon(db: Session, settings: Settings, upload: DatasetUpload) -> None:
    """Delete the upload, then its parts: a failed commit never leaves a row whose parts are gone."""
    upload_id = upload.id
    db.delete(upload)
    db.commit()
    shutil.rmtree(folder(settings, upload_id), ignore_errors=True)


def _blocks(settings: Settings, upload: DatasetUpload) -> Iterator[bytes]:
    where = folder(settings, upload.id)
    for index in range(_parts(upload)):
        with (where / f"{index}.part").open("rb") as f:
            while block := f.read(1 << 20):
                yield block


def parse(blocks: Iterator[bytes], sha256: str | None = None) -> list[dict[str, Any]]:
    """The items of a JSONL byte stream, or a 422 naming every bad line by its number (the first
    BAD_LINES_SHOWN of them in `errors`); with `sha256`, the stream must match it first."""
    digest = hashlib.sha256()
    items: list[dict[str, Any]] = []
    bad: list[tuple[int, str]] = []
    lineno = 0
    for lineno, line in _lines(blocks, digest):
        if not line.strip():
            continue
        parsed = _line_item(line)
        if isinstance(parsed, str):
            bad.append((lineno, parsed))
        elif not bad:
            items.append(parsed)
        if len(items) > MAX_ITEMS:
            raise ApiError(422, f"more than {MAX_ITEMS} items", field="file")
    if sha256 is not None and digest.hexdigest() != sha256:
        raise ApiError(422, "the file does not match the sha256 given when the upload started", field="sha256")
    if bad:
        shown = "; ".join(f"line {n}: {why}" for n, why in bad[:5])
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        err = ApiError(422, f"{len(bad)} bad line{'s' if len(bad) > 1 else ''} of {lineno}: {shown}{more}",
                       field="file")
        err.errors = [{"field": "file", "reason": f"line {n}: {why}"} for n, why in bad[:BAD_LINES_SHOWN]]
        raise err
    if not items:
        raise ApiError(422, "the file has no items", field="file")
    return items


def _lines(blocks: Iterator[bytes], digest: Any) -> Iterator[tuple[int, bytes]]:
    pending, lineno = b"", 0
    for block in blocks:
        digest.update(block)
        pending += block
        *whole, pending = pending.split(b"\n")
        for line in whole:
            lineno += 1
            yield lineno, line
        if len(pending) > MAX_LINE_BYTES:
            raise ApiError(422, f"line {lineno + 1}: longer than {MAX_LINE_BYTES} bytes", field="file")
    if pending:
        yield lineno + 1, pending


def _line_item(line: bytes) -> dict[str, Any] | str:
    """The line's item, or why it is not one."""
    try:
        value = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return f"not valid JSON ({exc})"
    if not isinstance(value, dict):
        return f"not a JSON object: each line is one item, like {{\"prompt\": ...}}, not a {type(value).__name__}"
    try:
        item = _item.validate_python(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        return f"key {err['loc'][0]!r}: {reason(err)}" if err["loc"] else reason(err)
    if problem := item_problem(item):
        return problem
    return {k: [t.model_dump(mode="json") for t in v] if isinstance(v, list) else v for k, v in item.items()}


def store(db: Session, user: User, name: str, items: list[dict[str, Any]], sha256: str | None = None) -> Dataset:
    keys = sorted({k for item in items for k in item})[:64]
    dataset = Dataset(owner_id=user.id, name=name, num_items=len(items), keys=keys, sha256=sha256)
    db.add(dataset)
    db.flush()
    for start_at in range(0, len(items), INSERT_BATCH):
        db.execute(insert(DatasetItem), [{"dataset_id": dataset.id, "index": i, "data": it}
                                         for i, it in enumerate(items[start_at:start_at + INSERT_BATCH], start_at)])
    return dataset
