"""Model folders as weight versions: split into fixed-size sha256-checked chunks plus a manifest, and
put back together. Pure Python (hashlib), shared by the learner (publish) and the worker (assemble)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

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


def _file_infos(folder: Path, files: list[Path]) -> list[FileInfo]:
    infos, offset = [], 0
    for path in files:
        digest, size = hashlib.sha256(), 0
        with open(path, "rb") as fh:
            while block := fh.read(1 << 20):
                digest.update(block)
                size += len(block)
        infos.append(FileInfo(path=path.relative_to(folder).as_posix(), size=size, sha256=digest.hexdigest(),
                              offset=offset))
        offset += size
    return infos


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
    """Hash every file and every chunk of a model folder (reads the folder twice, holds one chunk).
    `paths` names other files than a model folder's (a learner checkpoint's)."""
    files = _file_infos(folder, paths if paths is not None else model_files(folder))
    chunks = [ChunkInfo(index=i, size=len(c), sha256=hashlib.sha256(c).hexdigest())
              for i, c in enumerate(iter_stream(folder, files, chunk_size))]
    return Manifest(version=version, step=step, chunk_size=chunk_size, total_size=sum(f.size for f in files),
                    files=files, chunks=chunks, tensor_index=tensor_index or {}, created_at=datetime.now(UTC))


def verify_chunk(manifest: Manifest, index: int, data: bytes) -> None:
    expected = manifest.chunks[index]
    if len(data) != expected.size:
        raise SnapshotError(f"chunk {index}: {len(data)} bytes, expected {expected.size}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected.sha256:
        raise SnapshotError(f"chunk {index}: sha256 {digest} does not match the manifest")


def assemble(manifest: Manifest, read_chunk: Callable[[int], bytes], out: Path) -> Path:
    """Rebuild the model folder from verified chunks: files are written as *.tmp, checked against their
    whole-file sha256, then renamed; `manifest.json` is written last as the completion marker."""
    out.mkdir(parents=True, exist_ok=True)
    chunk_index, pending = 0, b""
    for f in manifest.files:
        target = out / f.path
        _safe_target(out, target)
        target.parent.mkdir(parents=True, exist_ok=True)
        digest, remaining = hashlib.sha256(), f.size
        tmp = target.with_name(target.name + ".tmp")
        with open(tmp, "wb") as fh:
            while remaining:
                if not pending:
                    pending = read_chunk(chunk_index)
                    verify_chunk(manifest, chunk_index, pending)
                    chunk_index += 1
                piece, pending = pending[:remaining], pending[remaining:]
                fh.write(piece)
                digest.update(piece)
                remaining -= len(piece)
            fh.flush()
            os.fsync(fh.fileno())
        if digest.hexdigest() != f.sha256:
            raise SnapshotError(f"{f.path}: whole-file sha256 does not match the manifest")
        os.replace(tmp, target)
    atomic_write(out / "manifest.json", manifest.model_dump_json().encode())
    return out


def _safe_target(root: Path, target: Path) -> None:
    if not target.resolve().is_relative_to(root.resolve()):
        raise SnapshotError(f"manifest path escapes the folder: {target}")


def atomic_write(path: Path, data: bytes) -> None:
    """Write *.tmp, fsync, rename: readers see the whole file or none of it."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def is_complete(folder: Path) -> bool:
    return (folder / "manifest.json").exists()
