"""Proof of possession: ranges of a version's bytes whose hashes only a copy of that version can give.

A version's bytes are its model folder as one stream: the files of `Manifest.target_files()` concatenated
in that order (for a delta, the folder it rebuilds; for a LoRA adapter version, the adapter folder).
At publication the learner draws PROBES of the stream (`draw_probes`: ranges from a secure RNG, each with
the sha256 of its bytes) and gives them to the control plane, which keeps them secret and challenges a
worker that lists the version as held with the range of one of them; the worker hashes that range of
its copy (`answer`). A range is drawn where the version differs from the one published before it, so a
copy of the previous version (about 99 % of bf16 bytes are unchanged step to step) cannot answer it.
"""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

from .deltas import Folder
from .protocol import Challenge, FileRef, Probe, Proof
from .protocol.weights import PROBE_BYTES

PROBES = 32
RETRIES = 8  # draws per probe that must differ from the previous version, before any range is taken


def draw_probes(folder: Path, files: list[FileRef], base: Folder | None = None, n: int = PROBES) -> list[Probe]:
    """`n` secret probes of the version in `folder`, each a range unlike the same range of `base` (the
    version published before it) when one of RETRIES * n draws finds such: a version identical to its base
    gets probes anyway, since then holding the base is holding it."""
    size = sum(f.size for f in files)
    length = min(PROBE_BYTES, size)
    rng = secrets.SystemRandom()
    probes: list[Probe] = []
    for attempt in range(n * (RETRIES + 1)):
        offset = rng.randrange(size - length + 1)
        data = read_range(folder, files, offset, length)
        if base is not None and attempt < n * RETRIES and _base_bytes(base, files, offset, length) == data:
            continue
        probes.append(Probe(offset=offset, length=length, sha256=hashlib.sha256(data).hexdigest()))
        if len(probes) == n:
            break
    return probes


def answer(folder: Path, files: list[FileRef], challenge: Challenge) -> Proof:
    """The proof that `folder` (a held copy of `challenge.version`, with its manifest's `files`) holds the
    challenged range. Raises ValueError for a range outside the version, OSError if a file is gone."""
    data = read_range(folder, files, challenge.offset, challenge.length)
    return Proof(version=challenge.version, offset=challenge.offset, length=challenge.length,
                 sha256=hashlib.sha256(data).hexdigest())


def read_range(folder: Path, files: list[FileRef], offset: int, length: int) -> bytes:
    """Bytes [offset, offset + length) of the files of `folder` concatenated in order."""
    out = bytearray()
    for path, start, n in _pieces(files, offset, length):
        with open(folder / path, "rb") as fh:
            fh.seek(start)
            out += fh.read(n)
    if len(out) != length:
        raise ValueError(f"bytes {offset}..{offset + length} are not all in the version (or a file is short)")
    return bytes(out)


def _pieces(files: list[FileRef], offset: int, length: int) -> list[tuple[str, int, int]]:
    """(path, offset in the file, bytes) of each file the range covers."""
    pieces, end, file_start = [], offset + length, 0
    for f in files:
        lo, hi = max(offset, file_start), min(end, file_start + f.size)
        if lo < hi:
            pieces.append((f.path, lo - file_start, hi - lo))
        file_start += f.size
    return pieces


def _base_bytes(base: Folder, files: list[FileRef], offset: int, length: int) -> bytes | None:
    """The same range read from the base's files of the same paths; None where the base lacks a piece."""
    sizes = {f.path: f.size for f in base.files}
    out = bytearray()
    for path, start, n in _pieces(files, offset, length):
        if sizes.get(path, -1) < start + n:
            return None
        with open(base.path / path, "rb") as fh:
            fh.seek(start)
            out += fh.read(n)
    return bytes(out)
