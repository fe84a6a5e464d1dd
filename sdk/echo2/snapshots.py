"""Model folders as weight versions: split into fixed-size sha256-checked chunks plus a manifest, and
put back together. Pure Python (hashlib), shared by the learner (publish) and the worker (assemble)."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

from .protocol import ChunkInfo, FileInfo, Manifest

DEFAULT_CHUNK_SIZE = 8 * 2**20
# Only these file kinds travel: safetensors weights, JSON configs/tokenizer, and text vocabularies.
# Pickled weights (.bin, .pt) never do.
ALLOWED_SUFFIXES = (".safetensors", ".json", ".txt", ".model", ".jinja")


class SnapshotError(ValueError):
    pass


def model_files(folder: Path) -> list[Path]:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name.endswith(ALLOWED_SUFFIXES))
    if not any(p.suffix == ".safetensors" for p in files):
        raise SnapshotError(f"{folder} has no .safetensors weights (pickle formats are not accepted)")
    return files


def iter_stream(folder: Path, files: list[FileInfo], chunk_size: int) -> Iterator[bytes]:
    """The concatenation of the files, cut into chunk_size pieces (the last may be shorter)."""
    buf = bytearray()
    for f in files:
        with open(folder / f.path, "rb") as fh:
            while block := fh.read(chunk_size):
                buf += block
                while len(buf) >= chunk_size:
                    yield bytes(buf[:chunk_size])
                    del buf[:chunk_size]
    if buf:
        yield bytes(buf)


def build_manifest(folder: Path, version: int, step: int, chunk_size: int = DEFAULT_CHUNK_SIZE,
                   tensor_index: dict[str, str] | None = None, paths: list[Path] | None = None) -> Manifest:
    """Hash every file and every chunk of a model folder, reading it once (a block at a time).
    `paths` names other files than a model folder's (a learner checkpoint's)."""
    chunks = _Chunks(chunk_size)
    files, offset = [], 0
    for path in paths if paths is not None else model_files(folder):
        digest, size = hashlib.sha256(), 0
        with open(path, "rb") as fh:
            while block := fh.read(1 << 20):
                digest.update(block)
                chunks.update(block)
                size += len(block)
        files.append(FileInfo(path=path.relative_to(folder).as_posix(), size=size, sha256=digest.hexdigest(),
                              offset=offset))
        offset += size
    return Manifest(version=version, step=step, chunk_size=chunk_size, total_size=offset, files=files,
                    chunks=chunks.done(), tensor_index=tensor_index or {}, created_at=datetime.now(UTC))


class _Chunks:
    """sha256 of each chunk_size piece of a byte stream fed in blocks of any size."""

    def __init__(self, chunk_size: int) -> None:
        self.size, self.infos, self._digest, self._filled = chunk_size, list[ChunkInfo](), hashlib.sha256(), 0

    def update(self, block: bytes) -> None:
        view = memoryview(block)
        while view:
            take = min(len(view), self.size - self._filled)
            self._digest.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.size:
                self._close()

    def done(self) -> list[ChunkInfo]:
        if self._filled:
            self._close()
        return self.infos

    def _close(self) -> None:
        self.infos.append(ChunkInfo(index=len(self.infos), size=self._filled, sha256=self._digest.hexdigest()))
        self._digest, self._filled = hashlib.sha256(), 0


def verify_chunk(manifest: Manifest, index: int, data: bytes) -> None:
    expected = manifest.chunks[index]
    if len(data) != expected.size:
        raise SnapshotError(f"chunk {index}: {len(data)} bytes, expected {expected.size}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected.sha256:
        raise SnapshotError(f"chunk {index}: sha256 {digest} does not match the manifest")


def assemble(manifest: Manifest, read_chunk: Callable[[int], bytes], out: Path) -> Path:
    """Rebuild the model folder from verified chunks: each file is checked against its whole-file sha256
    before it replaces anything (atomic_file); `manifest.json` is written last as the completion marker."""
    out.mkdir(parents=True, exist_ok=True)
    chunk_index, pending = 0, b""
    for f in manifest.files:
        target = out / f.path
        _safe_target(out, target)
        target.parent.mkdir(parents=True, exist_ok=True)
        digest, remaining = hashlib.sha256(), f.size
        with atomic_file(target) as fh:
            while remaining:
                if not pending:
                    pending = read_chunk(chunk_index)
                    verify_chunk(manifest, chunk_index, pending)
                    chunk_index += 1
                piece, pending = pending[:remaining], pending[remaining:]
                fh.write(piece)
                digest.update(piece)
                remaining -= len(piece)
            if digest.hexdigest() != f.sha256:
                raise SnapshotError(f"{f.path}: whole-file sha256 does not match the manifest")
    atomic_write(out / "manifest.json", manifest.model_dump_json().encode())
    return out


def _safe_target(root: Path, target: Path) -> None:
    if not target.resolve().is_relative_to(root.resolve()):
        raise SnapshotError(f"manifest path escapes the folder: {target}")


@contextmanager
def atomic_file(path: Path, mode: int = 0o644) -> Iterator[BinaryIO]:
    """The one way Echo2 writes a file others read: into *.tmp (created with `mode`, so a secret is never
    readable by others), fsynced, then renamed over `path`. Readers see the whole file or none of it;
    when the block raises (a hash that does not match, say), the *.tmp is removed and `path` untouched."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)  # O_CREAT's mode does not apply to a *.tmp left over from a crash
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write `data` to `path` through atomic_file."""
    with atomic_file(path, mode) as fh:
        fh.write(data)


def replace_dir(staging: Path, final: Path) -> None:
    """Swap a fully written folder in for `final` (each file in it written by atomic_file or fsynced)."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)


def is_complete(folder: Path) -> bool:
    return (folder / "manifest.json").exists()
