"""A version published only as a delta, rebuilt in full on the control plane when a user asks for its weights.

The learner publishes most versions as deltas (JobSpec.weights.keyframe_every), which workers apply to the
version before; a user downloading or exporting a checkpoint needs the model itself. A job that ended without a
final version (cancelled, failed, its learner dead) kept only its newest version, a delta whose keyframe was
collected: its weights were lost. Retention now keeps the chain behind such a version (retention.kept), and the
first download or export of a delta-only version rebuilds it here, exactly as a worker would (every chunk and every
rebuilt file checked against its manifest), and stores the result as its full form, which later reads serve.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import threading
from pathlib import Path

from echo2.deltas import Folder, apply_delta
from echo2.protocol import Form, Manifest
from echo2.snapshots import assemble, build_manifest
from sqlalchemy.orm import Session

from ..errors import ApiError
from ..models import WeightVersion
from ..storage import BlobStore
from .versions import canonical

_building = threading.Lock()  # one rebuild at a time in a process: each writes a whole model to disk


def full_manifest(db: Session, blobs: BlobStore, row: WeightVersion) -> Manifest:
    """The version's full form, rebuilt first when it was published only as a delta."""
    if row.manifest is not None:
        return Manifest.model_validate(row.manifest)
    chain = _chain(db, row)
    with _building:
        db.refresh(row)
        if row.manifest is None:  # not rebuilt meanwhile (another request of this process)
            manifest = _rebuild(blobs, row.job_id, chain)
            row.manifest = manifest.model_dump(mode="json")
            row.manifest_sha256 = hashlib.sha256(canonical(manifest)).hexdigest()
            row.total_size, row.num_chunks = manifest.total_size, len(manifest.chunks)
            db.commit()
    return Manifest.model_validate(row.manifest)


def _chain(db: Session, row: WeightVersion) -> list[WeightVersion]:
    """The newest keyframe at or before the version, then each delta up to it; a 409 if a link was collected."""
    chain = [row]
    while chain[-1].manifest is None:
        base = chain[-1].delta_base
        below = db.get(WeightVersion, (row.job_id, base)) if base is not None else None
        if below is None or below.collected_at is not None:
            raise ApiError(409, f"version {row.version} was published only as a delta and the versions it is built "
                           f"from are deleted: download a version stored in full", field="version")
        chain.append(below)
    return list(reversed(chain))


def _rebuild(blobs: BlobStore, job_id: str, chain: list[WeightVersion]) -> Manifest:
    keyframe = Manifest.model_validate(chain[0].manifest)
    work = blobs.root / job_id / "rebuild"
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        folder = _assembled(blobs, job_id, keyframe, Form.full, Path(tmp) / "base")
        for row in chain[1:]:
            delta = Manifest.model_validate(row.delta_manifest)
            payload = _assembled(blobs, job_id, delta, Form.delta, Path(tmp) / f"d{row.version}")
            files = Manifest.model_validate_json((folder / "manifest.json").read_bytes()).target_files()
            rebuilt = apply_delta(delta, payload, Folder(delta.delta.base_version, folder, files),  # type: ignore[union-attr]
                                  Path(tmp) / f"v{row.version}")
            shutil.rmtree(payload)
            shutil.rmtree(folder)
            folder = rebuilt
        target, last = chain[-1], Manifest.model_validate(chain[-1].delta_manifest)
        paths = [folder / f.path for f in last.target_files()]  # the model's files, not the folder's manifest.json
        manifest = build_manifest(folder, target.version, target.step, keyframe.chunk_size, paths=paths)
        manifest = manifest.model_copy(update={"adapter": last.adapter})
        _store(blobs, job_id, folder, manifest)
    return manifest


def _assembled(blobs: BlobStore, job_id: str, manifest: Manifest, form: Form, out: Path) -> Path:
    def read(index: int) -> bytes:
        return blobs.chunk_path(job_id, manifest.version, index, form).read_bytes()

    return assemble(manifest, read, out)


def _store(blobs: BlobStore, job_id: str, folder: Path, manifest: Manifest) -> None:
    """The rebuilt files, cut into the manifest's chunks, published as the version's full form."""
    chunks = iter(manifest.chunks)
    pending = b""
    for f in manifest.files:
        with open(folder / f.path, "rb") as fh:
            while block := fh.read(1 << 20):
                pending += block
                while len(pending) >= manifest.chunk_size:
                    info = next(chunks)
                    blobs.put_chunk(job_id, manifest.version, info.index, pending[:info.size], info.sha256)
                    pending = pending[info.size:]
    for info in chunks:  # the last, shorter chunk
        blobs.put_chunk(job_id, manifest.version, info.index, pending[:info.size], info.sha256)
        pending = pending[info.size:]
    blobs.publish(job_id, manifest)
