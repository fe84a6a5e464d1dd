"""Delta versions: a weight version sent as what changed since an earlier one (its base).

About 99 % of bf16 weights are bit-identical from one RL step to the next, so the bitwise XOR of a
model file with its base's is almost all zero bytes, and zstd shrinks it to about 1 % of the file
(docs/BENCHMARKS.md, "Weights that travel"). A delta is a folder of payload files, one per model file
that changed:

    <path>.xor.zst   zstd(target XOR base)   the base has a file of that path and size
    <path>.zst       zstd(target)            a new file, or one whose size changed

A file identical to the base's travels not at all. The payload is chunked, hashed and relayed like any
version; its manifest (`Manifest.delta`) names the base version, the digest of the base's files, and
the `target` files with their sha256. `apply_delta` rebuilds every target file beside the base, checks it
against that sha256 before it renames it, and writes the completion marker last: a worker loads the
result only once it is bit-identical to what the learner published.

Needs numpy and zstandard (the learner's and the worker's installs have both); imported lazily.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .protocol import DeltaInfo, FileRef, Manifest
from .snapshots import SnapshotError, atomic_file, atomic_write, build_manifest, model_files

XOR_SUFFIX, FULL_SUFFIX = ".xor.zst", ".zst"
BLOCK = 1 << 20
ZSTD_LEVEL = 1  # level 3 compressed XOR payloads no smaller in our measurements, and took longer


class DeltaError(SnapshotError):
    """A delta that cannot be applied: wrong base, corrupt payload, or a result that does not hash right."""


def file_refs(folder: Path, paths: Iterable[Path] | None = None) -> list[FileRef]:
    """(path, size, sha256) of a model folder's files, in manifest order."""
    refs = []
    for path in paths if paths is not None else model_files(folder):
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            while block := fh.read(BLOCK):
                digest.update(block)
        refs.append(FileRef(path=path.relative_to(folder).as_posix(), size=path.stat().st_size,
                            sha256=digest.hexdigest()))
    return refs


def files_digest(files: Iterable[FileRef]) -> str:
    """One hash naming a set of files by their paths and contents (what a delta's base must be)."""
    lines = sorted(f"{f.path}\t{f.size}\t{f.sha256}\n" for f in files)
    return hashlib.sha256("".join(lines).encode()).hexdigest()


@dataclass(frozen=True)
class Folder:
    """A version's model folder on disk and its files (from its manifest, or `file_refs`)."""

    version: int
    path: Path
    files: list[FileRef]


def build_delta(base: Folder, target: Folder, out: Path, step: int, chunk_size: int) -> Manifest | None:
    """Write under `out` the payload that turns `base` into `target` and return its manifest (version
    `target.version`); None when no file changed."""
    old = {f.path: f for f in base.files}
    out.mkdir(parents=True, exist_ok=True)
    payload = []
    for ref in target.files:
        prev = old.get(ref.path)
        if prev is not None and prev.sha256 == ref.sha256:
            continue
        if prev is not None and prev.size == ref.size:
            dest = out / (ref.path + XOR_SUFFIX)
            _compress(_xor_blocks(base.path / ref.path, target.path / ref.path), dest)
        else:
            dest = out / (ref.path + FULL_SUFFIX)
            _compress(_blocks(target.path / ref.path), dest)
        payload.append(dest)
    if not payload:
        return None
    info = DeltaInfo(base_version=base.version, base_digest=files_digest(base.files), target=target.files)
    return build_manifest(out, target.version, step, chunk_size, paths=payload).model_copy(update={"delta": info})


def apply_delta(manifest: Manifest, payload: Path, base: Folder, out: Path) -> Path:
    """Rebuild the target folder of delta `manifest` in `out` from `payload` (its assembled files) and the
    held `base`. Every file is checked against its target sha256 before it is renamed into place;
    `manifest.json` is written last. Raises DeltaError."""
    if manifest.delta is None:
        raise DeltaError(f"version {manifest.version} is not a delta")
    if files_digest(base.files) != manifest.delta.base_digest:
        raise DeltaError(f"the held version {manifest.delta.base_version} is not the base this delta was made "
                         "against (its files differ)")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for ref in manifest.delta.target:
        dest = out / ref.path
        if not dest.resolve().is_relative_to(out.resolve()):
            raise DeltaError(f"target path escapes the folder: {ref.path}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        xor, full = payload / (ref.path + XOR_SUFFIX), payload / (ref.path + FULL_SUFFIX)
        if xor.exists():
            blocks = _xor_stream(_decompressed(xor, ref.size), base.path / ref.path)
        elif full.exists():
            blocks = _decompressed(full, ref.size)
        else:
            blocks = _blocks(base.path / ref.path)
        _write_checked(blocks, dest, ref)
    atomic_write(out / "manifest.json", manifest.model_dump_json().encode())
    return out


def _write_checked(blocks: Iterator[bytes], dest: Path, ref: FileRef) -> None:
    digest, size = hashlib.sha256(), 0
    try:
        with atomic_file(dest) as fh:
            for block in blocks:
                size += len(block)
                if size > ref.size:
                    raise DeltaError(f"{ref.path}: the delta rebuilds more than its {ref.size} bytes")
                digest.update(block)
                fh.write(block)
            if size != ref.size or digest.hexdigest() != ref.sha256:
                raise DeltaError(f"{ref.path}: the rebuilt file does not match the sha256 the learner published")
    except FileNotFoundError as exc:
        raise DeltaError(f"{ref.path}: {exc.strerror}: {exc.filename}") from None


def _blocks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        while block := fh.read(BLOCK):
            yield block


def _xor(a: bytes, b: bytes) -> bytes:
    import numpy as np

    return np.bitwise_xor(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)).tobytes()


def _xor_blocks(base: Path, target: Path) -> Iterator[bytes]:
    with open(base, "rb") as old:
        for block in _blocks(target):
            yield _xor(block, old.read(len(block)))


def _xor_stream(diff: Iterator[bytes], base: Path) -> Iterator[bytes]:
    with open(base, "rb") as old:
        for block in diff:
            base_block = old.read(len(block))
            if len(base_block) != len(block):
                raise DeltaError(f"{base.name}: the base file is shorter than the delta")
            yield _xor(block, base_block)


def _compress(blocks: Iterator[bytes], dest: Path) -> None:
    import zstandard

    with open(dest, "wb") as fh, zstandard.ZstdCompressor(level=ZSTD_LEVEL).stream_writer(fh, closefd=False) as z:
        for block in blocks:
            z.write(block)


def _decompressed(path: Path, limit: int) -> Iterator[bytes]:
    """The decompressed bytes of `path`, never more than `limit` + 1 of them (a bomb stops early)."""
    import zstandard

    left = limit + 1
    with open(path, "rb") as fh:
        reader: Any = zstandard.ZstdDecompressor().stream_reader(fh)
        try:
            while left > 0 and (block := reader.read(min(BLOCK, left))):
                left -= len(block)
                yield block
        except zstandard.ZstdError as exc:
            raise DeltaError(f"{path.name}: corrupt zstd payload ({exc})") from None

