"""The origin's blob store for weight versions: chunks land in a staging folder, verified, and the
version becomes visible only by renaming the folder after its manifest is written (completion last).
A version's two forms have a folder each: `v12` (full) and `v12.delta`. The learner's own checkpoints
are stored the same way, by a second store over the same root whose folders carry another prefix
(`c12` beside `v12`)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from echo2.protocol import Form, Manifest
from echo2.snapshots import atomic_write, replace_dir

log = logging.getLogger(__name__)
_SUFFIX = {Form.full: "", Form.delta: ".delta"}
PINS = ".pins"  # versions being downloaded, as hard-linked copies (BlobStore.pin)
PIN_MAX_AGE_S = 86_400.0  # a pin older than this was left by a process that died mid-download


class ChunkError(ValueError):
    pass


class BlobStore:
    def __init__(self, root: Path, prefix: str = "v") -> None:
        self.root, self.prefix = root, prefix
        self._folder = re.compile(rf"^{prefix}(\d+)(?:\.delta)?(\.staging)?$")
        root.mkdir(parents=True, exist_ok=True)

    def _final(self, job_id: str, version: int, form: Form = Form.full) -> Path:
        return self.root / job_id / f"{self.prefix}{version}{_SUFFIX[form]}"

    def _staging(self, job_id: str, version: int, form: Form = Form.full) -> Path:
        return self.root / job_id / f"{self.prefix}{version}{_SUFFIX[form]}.staging"

    def put_chunk(self, job_id: str, version: int, index: int, data: bytes, sha256: str,
                  form: Form = Form.full) -> None:
        digest = hashlib.sha256(data).hexdigest()
        if digest != sha256:
            raise ChunkError(f"chunk {index}: sha256 of the body is {digest}, header says {sha256}")
        staging = self._staging(job_id, version, form)
        staging.mkdir(parents=True, exist_ok=True)
        atomic_write(staging / f"{index}.chunk", data)
        atomic_write(staging / f"{index}.sha256", digest.encode())

    def publish(self, job_id: str, manifest: Manifest) -> float:
        """Check every chunk the manifest names, then make the version visible. Returns upload seconds."""
        staging = self._staging(job_id, manifest.version, manifest.form)
        for chunk in manifest.chunks:
            self._check_staged(staging, chunk.index, chunk.size, chunk.sha256)
        extra = {p.name for p in staging.glob("*.chunk")} - {f"{c.index}.chunk" for c in manifest.chunks}
        if extra:
            raise ChunkError(f"uploaded chunks not named by the manifest: {sorted(extra)[:5]}")
        atomic_write(staging / "manifest.json", manifest.model_dump_json().encode())
        first_upload = min(p.stat().st_mtime for p in staging.glob("*.chunk"))
        final = self._final(job_id, manifest.version, manifest.form)
        replace_dir(staging, final)
        return max(0.0, (final / "manifest.json").stat().st_mtime - first_upload)

    def published_manifest(self, job_id: str, version: int, form: Form = Form.full) -> Manifest | None:
        """The manifest of a version's form stored here in full (its folder published), or None."""
        path = self._final(job_id, version, form) / "manifest.json"
        return Manifest.model_validate_json(path.read_bytes()) if path.exists() else None

    @staticmethod
    def _check_staged(staging: Path, index: int, size: int, sha256: str) -> None:
        path = staging / f"{index}.chunk"
        if not path.exists():
            raise ChunkError(f"chunk {index} was not uploaded")
        if path.stat().st_size != size:
            raise ChunkError(f"chunk {index} is {path.stat().st_size} bytes, the manifest says {size}")
        if (staging / f"{index}.sha256").read_text() != sha256:
            raise ChunkError(f"chunk {index}: uploaded sha256 differs from the manifest")

    def drop(self, job_id: str, versions: list[int]) -> None:
        """Delete the files of collected versions, both forms (after the commit that marked them collected)."""
        for version in versions:
            for form in Form:
                shutil.rmtree(self._final(job_id, version, form), ignore_errors=True)

    def drop_staging(self, job_id: str, version: int) -> None:
        for form in Form:
            shutil.rmtree(self._staging(job_id, version, form), ignore_errors=True)

    def pin(self, job_id: str, manifest: Manifest) -> tuple[BlobStore, Callable[[], None]]:
        """A copy of a published version's folder made of hard links (no byte is copied), in a store of its own,
        and what removes it: retention deleting the version leaves the copy whole, so a download (minutes for a
        real model, while the learner publishes and retention collects) streams from it to the end. Raises
        FileNotFoundError if the version was deleted first. Where the disk cannot hard-link (another device, a
        filesystem without links), the version itself is read, as before there were pins."""
        copy = BlobStore(self.root / PINS / secrets.token_hex(8), self.prefix)
        target = copy._final(job_id, manifest.version, manifest.form)
        try:
            target.mkdir(parents=True)
            for path in self._final(job_id, manifest.version, manifest.form).iterdir():
                os.link(path, target / path.name)
        except FileNotFoundError:
            shutil.rmtree(copy.root, ignore_errors=True)
            raise
        except OSError as exc:
            shutil.rmtree(copy.root, ignore_errors=True)
            log.warning("version %d of job %s is read unpinned: %s", manifest.version, job_id, exc)
            return self, lambda: None
        return copy, lambda: shutil.rmtree(copy.root, ignore_errors=True)

    def drop_stale_pins(self, max_age_s: float = PIN_MAX_AGE_S) -> None:
        """Remove pinned copies a process that died mid-download left behind."""
        for pin in (self.root / PINS).iterdir() if (self.root / PINS).is_dir() else ():
            try:
                stale = pin.stat().st_mtime < time.time() - max_age_s
            except FileNotFoundError:  # its download ended meanwhile
                continue
            if stale:
                shutil.rmtree(pin, ignore_errors=True)

    def stored(self) -> Iterator[tuple[str, int, bool]]:
        """(job id, version, is a staging upload) of every version folder on disk (each form)."""
        for job_dir in self.root.iterdir():
            if job_dir.name == PINS:
                continue
            for folder in job_dir.iterdir() if job_dir.is_dir() else ():
                m = self._folder.match(folder.name)
                if m:
                    yield job_dir.name, int(m.group(1)), m.group(2) is not None

    def finals(self, job_id: str) -> list[int]:
        """The numbers of the job's completed folders (versions, or checkpoints), ascending."""
        return sorted({v for j, v, staging in self.stored() if j == job_id and not staging})

    def read_file(self, job_id: str, manifest: Manifest, path: str, max_bytes: int) -> bytes | None:
        """One file of a published version, out of its chunks; None if absent or larger than max_bytes."""
        info = next((f for f in manifest.files if f.path == path), None)
        if info is None or info.size > max_bytes:
            return None
        out, pos, end = bytearray(), info.offset, info.offset + info.size
        while pos < end:
            index, skip = divmod(pos, manifest.chunk_size)
            with open(self.chunk_path(job_id, manifest.version, index, manifest.form), "rb") as fh:
                fh.seek(skip)
                piece = fh.read(min(end - pos, manifest.chunk_size - skip))
            if not piece:
                raise ChunkError(f"chunk {index} of version {manifest.version} is shorter than its manifest says")
            out += piece
            pos += len(piece)
        return bytes(out)

    def iter_file(self, job_id: str, manifest: Manifest, path: str, block: int = 1 << 20) -> Iterator[bytes]:
        """One file of a published version streamed out of its chunks, `block` bytes at most at a time."""
        info = next(f for f in manifest.files if f.path == path)
        pos, end = info.offset, info.offset + info.size
        while pos < end:
            index, skip = divmod(pos, manifest.chunk_size)
            with open(self.chunk_path(job_id, manifest.version, index, manifest.form), "rb") as fh:
                fh.seek(skip)
                piece = fh.read(min(end - pos, manifest.chunk_size - skip, block))
            if not piece:
                raise ChunkError(f"chunk {index} of version {manifest.version} is shorter than its manifest says")
            pos += len(piece)
            yield piece

    def job_file(self, job_id: str, name: str) -> Path:
        """A file kept for the job's whole life beside its versions (e.g. the tokenizer for display)."""
        return self.root / job_id / name

    def chunk_path(self, job_id: str, version: int, index: int, form: Form = Form.full) -> Path:
        return self._final(job_id, version, form) / f"{index}.chunk"

    def iter_tar(self, job_id: str, manifest: Manifest, block: int = 1 << 20) -> Iterator[bytes]:
        """Stream the version's files as an uncompressed tar, reading chunks in order."""
        stream = self._iter_stream(job_id, manifest, block)
        pending = b""
        for f in manifest.files:
            info = tarfile.TarInfo(name=f.path)
            info.size, info.mode = f.size, 0o644
            yield info.tobuf(format=tarfile.PAX_FORMAT)
            remaining = f.size
            while remaining:
                if not pending:
                    pending = next(stream)
                piece, pending = pending[:remaining], pending[remaining:]
                remaining -= len(piece)
                yield piece
            if f.size % tarfile.BLOCKSIZE:
                yield b"\0" * (tarfile.BLOCKSIZE - f.size % tarfile.BLOCKSIZE)
        yield b"\0" * (2 * tarfile.BLOCKSIZE)

    def _iter_stream(self, job_id: str, manifest: Manifest, block: int) -> Iterator[bytes]:
        for chunk in manifest.chunks:
            with open(self.chunk_path(job_id, manifest.version, chunk.index), "rb") as fh:
                while data := fh.read(block):
                    yield data


def manifest_bytes(manifest: Manifest) -> bytes:
    return json.dumps(manifest.model_dump(mode="json"), sort_keys=True).encode()
