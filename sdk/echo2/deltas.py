"""Delta versions: a weight version sent as what changed since an earlier one (its base).

About 99 % of bf16 weights are bit-identical from one RL step to the next. A delta is a folder of payload
files, one per model file that changed:

    <path>.sparse.zst  zstd(sparse patch)      the base has a file of that path and size, and at most
                                               SPARSE_SHARE of its 16-bit words changed
    <path>.xor.zst     zstd(target XOR base)   the base has a file of that path and size (more changed)
    <path>.zst         zstd(target)            a new file, or one whose size changed

A sparse patch is sized by the words that changed, not by the file: the changed 16-bit words' positions
(as gaps from the one before) and their XOR with the base, each stored as byte planes (all low bytes, then
the next ones), which zstd shrinks further. On a SmolLM2 step that changed 0.65 % of the words, it was 1.44 MB
where XOR + zstd was 3.59 MB (docs/BENCHMARKS.md). The XOR form stays for the dense case: every word costs 2
bytes there against 6 (before compression) in a patch.

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

XOR_SUFFIX, FULL_SUFFIX, SPARSE_SUFFIX = ".xor.zst", ".zst", ".sparse.zst"
BLOCK = 1 << 20
ZSTD_LEVEL = 1  # level 3 compressed XOR payloads no smaller in our measurements, and took longer
SPARSE_LEVEL = 3  # a patch is small: level 3 made SmolLM2's 8 % smaller than level 1, at little cost
SPARSE_SHARE = 1 / 8  # of a file's words at most, changed, for a sparse patch
SPARSE_MAGIC = b"E2SPARSE1"
SPARSE_HEADER = len(SPARSE_MAGIC) + 8  # the magic, then the count of changed words (uint64 little-endian)


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


def build_delta(base: Folder, target: Folder, out: Path, step: int, chunk_size: int,
                sparse: bool = True) -> Manifest | None:
    """Write under `out` the payload that turns `base` into `target` and return its manifest (version
    `target.version`); None when no file changed. `sparse=False` never writes sparse patches (to measure
    the XOR form against them)."""
    old = {f.path: f for f in base.files}
    out.mkdir(parents=True, exist_ok=True)
    payload = []
    for ref in target.files:
        prev = old.get(ref.path)
        if prev is not None and prev.sha256 == ref.sha256:
            continue
        payload.append(_changed_file(base.path / ref.path, target.path / ref.path, prev is not None and
                                     prev.size == ref.size, out / ref.path, sparse))
    if not payload:
        return None
    info = DeltaInfo(base_version=base.version, base_digest=files_digest(base.files), target=target.files)
    return build_manifest(out, target.version, step, chunk_size, paths=payload).model_copy(update={"delta": info})


def _changed_file(base: Path, target: Path, same_size: bool, dest: Path, sparse: bool) -> Path:
    """The payload file for one changed model file: a sparse patch, its XOR with the base, or the file."""
    if same_size:
        patch = _sparse_patch(base, target) if sparse else None
        if patch is not None:
            out = dest.with_name(dest.name + SPARSE_SUFFIX)
            _compress(iter([patch]), out, SPARSE_LEVEL)
            return out
        out = dest.with_name(dest.name + XOR_SUFFIX)
        _compress(_xor_blocks(base, target), out)
        return out
    out = dest.with_name(dest.name + FULL_SUFFIX)
    _compress(_blocks(target), out)
    return out


def apply_onto(folder: Path, manifest: Manifest, payload: Path, out: Path) -> Path:
    """One step along a chain of deltas: delta `manifest` (its assembled `payload`) applied to the version
    assembled in `folder` (its manifest.json beside its files), into `out`; the payload and `folder` are removed."""
    assert manifest.delta is not None
    files = Manifest.model_validate_json((folder / "manifest.json").read_bytes()).target_files()
    rebuilt = apply_delta(manifest, payload, Folder(manifest.delta.base_version, folder, files), out)
    shutil.rmtree(payload)
    shutil.rmtree(folder)
    return rebuilt


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
        sparse = payload / (ref.path + SPARSE_SUFFIX)
        if sparse.exists():
            blocks = _patched(sparse, base.path / ref.path, ref.size)
        elif xor.exists():
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


def _compress(blocks: Iterator[bytes], dest: Path, level: int = ZSTD_LEVEL) -> None:
    import zstandard

    with open(dest, "wb") as fh, zstandard.ZstdCompressor(level=level).stream_writer(fh, closefd=False) as z:
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



def _sparse_patch(base: Path, target: Path) -> bytes | None:
    """The uncompressed sparse patch turning `base` into `target` (same size): header, gap planes, XOR
    planes. None when the size is odd or more than SPARSE_SHARE of the words changed."""
    import numpy as np

    size = target.stat().st_size
    if size % 2:
        return None
    budget, positions, values, offset = int(size // 2 * SPARSE_SHARE), [], [], 0
    with open(base, "rb") as old:
        for block in _blocks(target):
            diff = np.bitwise_xor(np.frombuffer(block, "<u2"), np.frombuffer(old.read(len(block)), "<u2"))
            changed = np.flatnonzero(diff)
            positions.append(changed + offset)
            values.append(diff[changed])
            offset += len(diff)
            budget -= len(changed)
            if budget < 0:
                return None
    where = np.concatenate(positions)
    gaps = np.diff(where, prepend=-1)
    if len(gaps) and int(gaps.max()) >= 1 << 32:
        return None  # a 16 GB stretch unchanged: the XOR form is as small
    return (SPARSE_MAGIC + len(where).to_bytes(8, "little") + _planes(gaps.astype("<u4"))
            + _planes(np.concatenate(values).astype("<u2")))


def _planes(values: Any) -> bytes:
    """Little-endian values as byte planes: every value's first byte, then every second byte, ..."""
    return values.view("u1").reshape(-1, values.itemsize).T.tobytes()


def _unplanes(data: bytes, count: int, dtype: str) -> Any:
    import numpy as np

    width = np.dtype(dtype).itemsize
    return np.frombuffer(data, "u1").reshape(width, count).T.copy().view(dtype).ravel()


def _patch_of(path: Path, size: int) -> tuple[Any, Any]:
    """A sparse payload's (positions, XOR values) for a file of `size` bytes, checked; raises DeltaError."""
    import numpy as np

    words = size // 2
    data = b"".join(_decompressed(path, SPARSE_HEADER + 6 * words))
    count = int.from_bytes(data[len(SPARSE_MAGIC):SPARSE_HEADER], "little")
    if not data.startswith(SPARSE_MAGIC) or count > words or len(data) != SPARSE_HEADER + 6 * count:
        raise DeltaError(f"{path.name}: not a sparse patch of a {size}-byte file")
    gaps = _unplanes(data[SPARSE_HEADER:SPARSE_HEADER + 4 * count], count, "<u4").astype(np.int64)
    positions = np.cumsum(gaps) - 1
    if count and (int(gaps.min()) < 1 or int(positions[-1]) >= words):
        raise DeltaError(f"{path.name}: the patch's positions are outside the file")
    return positions, _unplanes(data[SPARSE_HEADER + 4 * count:], count, "<u2")


def _patched(path: Path, base: Path, size: int) -> Iterator[bytes]:
    """The base's bytes with the sparse patch at `path` applied, block by block."""
    import numpy as np

    positions, values = _patch_of(path, size)
    first = 0  # the first patched word not applied yet
    offset = 0
    for block in _blocks(base):
        if len(block) % 2:
            raise DeltaError(f"{base.name}: the base file is not the size the patch was made against")
        words = np.frombuffer(block, "<u2").copy()
        last = int(np.searchsorted(positions, offset + len(words)))
        words[positions[first:last] - offset] ^= values[first:last]
        first, offset = last, offset + len(words)
        yield words.tobytes()
