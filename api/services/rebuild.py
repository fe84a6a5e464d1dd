"""A version published only as a delta, rebuilt in full on the control plane.

The learner publishes most versions as deltas (JobSpec.weights.keyframe_every), which workers apply to the
version before; a user downloading or exporting a checkpoint needs the model itself. A job that ended without a
final version (cancelled, failed, its learner dead) kept only its newest version, a delta whose keyframe was
collected: its weights were lost. Now retention keeps the chain behind such a version (retention.kept) until the
retention sweep rebuilds it, and a download or export of a delta-only version rebuilds it at once, exactly as a
worker would (every chunk and every rebuilt file checked against its manifest). The result is stored as the
version's full form, which later reads serve.

No transaction is held while a rebuild runs (minutes for a large model: on SQLite an open transaction holds the
one writer of every process), and two processes rebuilding one version at once both end with the first's files.
"""

from __future__ import annotations

import hashlib
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from echo2.deltas import DeltaError, apply_onto
from echo2.protocol import Form, Manifest
from echo2.snapshots import SnapshotError, assemble, build_manifest, iter_stream
from sqlalchemy.orm import Session

from ..errors import ApiError
from ..models import WeightVersion
from ..storage import BlobStore, ChunkError
from .versions import canonical

_building = threading.Lock()  # one rebuild at a time in a process: each writes a whole model to disk


@dataclass(frozen=True)
class _Link:
    version: int
    step: int
    manifest: Manifest  # the keyframe's full form, then each delta


def full_manifest(db: Session, blobs: BlobStore, row: WeightVersion) -> Manifest:
    """The version's full form, rebuilt first when it was published only as a delta. Ends the caller's
    transaction when it rebuilds."""
    if row.manifest is not None:
        return Manifest.model_validate(row.manifest)
    job_id, version, chain = row.job_id, row.version, _chain(db, row)
    db.commit()  # nothing held while the files are rebuilt
    with _building:
        manifest = blobs.published_manifest(job_id, version, Form.full) or _rebuilt(blobs, job_id, chain)
    row = db.get(WeightVersion, (job_id, version), with_for_update=True, populate_existing=True)
    assert row is not None
    if row.manifest is None:
        row.manifest = manifest.model_dump(mode="json")
        row.manifest_sha256 = hashlib.sha256(canonical(manifest)).hexdigest()
        row.total_size, row.num_chunks = manifest.total_size, len(manifest.chunks)
    db.commit()
    return Manifest.model_validate(row.manifest)


def _chain(db: Session, row: WeightVersion) -> list[_Link]:
    """The newest keyframe at or before the version, then each delta up to it; a 409 if a link was collected."""
    rows = [row]
    while rows[-1].manifest is None:
        base = rows[-1].delta_base
        below = db.get(WeightVersion, (row.job_id, base)) if base is not None else None
        if below is None or below.collected_at is not None:
            raise ApiError(409, f"version {row.version} was published only as a delta and the versions it is built "
                           "from are deleted: download a version stored in full", field="version")
        rows.append(below)
    keyframe, deltas = rows[-1], reversed(rows[:-1])
    return [_Link(keyframe.version, keyframe.step, Manifest.model_validate(keyframe.manifest)),
            *(_Link(r.version, r.step, Manifest.model_validate(r.delta_manifest)) for r in deltas)]


def _rebuilt(blobs: BlobStore, job_id: str, chain: list[_Link]) -> Manifest:
    try:
        return _rebuild(blobs, job_id, chain)
    except ChunkError:  # another process published the same version meanwhile (its staging moved away)
        if (done := blobs.published_manifest(job_id, chain[-1].version, Form.full)) is not None:
            return done
        raise
    except (DeltaError, SnapshotError, OSError) as exc:
        raise ApiError(409, f"version {chain[-1].version} could not be rebuilt from version {chain[0].version} and "
                       f"the deltas after it ({exc}): download a version stored in full", field="version") from exc


def _rebuild(blobs: BlobStore, job_id: str, chain: list[_Link]) -> Manifest:
    keyframe, target = chain[0].manifest, chain[-1]
    work = blobs.root / job_id / "rebuild"
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        folder = _assembled(blobs, job_id, keyframe, Form.full, Path(tmp) / "base")
        for link in chain[1:]:
            payload = _assembled(blobs, job_id, link.manifest, Form.delta, Path(tmp) / f"d{link.version}")
            folder = apply_onto(folder, link.manifest, payload, Path(tmp) / f"v{link.version}")
        paths = [folder / f.path for f in target.manifest.target_files()]  # not the folder's manifest.json
        manifest = build_manifest(folder, target.version, target.step, keyframe.chunk_size, paths=paths)
        manifest = manifest.model_copy(update={"adapter": target.manifest.adapter})
        _store(blobs, job_id, folder, manifest)
    return manifest


def _assembled(blobs: BlobStore, job_id: str, manifest: Manifest, form: Form, out: Path) -> Path:
    def read(index: int) -> bytes:
        return blobs.chunk_path(job_id, manifest.version, index, form).read_bytes()

    return assemble(manifest, read, out)


def _store(blobs: BlobStore, job_id: str, folder: Path, manifest: Manifest) -> None:
    """The rebuilt files, cut into the manifest's chunks, published as the version's full form."""
    for info, data in zip(manifest.chunks, iter_stream(folder, manifest.files, manifest.chunk_size), strict=True):
        blobs.put_chunk(job_id, manifest.version, info.index, data, info.sha256)
    blobs.publish(job_id, manifest)
