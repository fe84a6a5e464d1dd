"""Weight versions on this worker's disk: verified chunks while a version arrives, the assembled folder
once it is complete, and chunk reads for the relay server in both states.

A version is held in one or both of its forms (echo2.protocol.weights). Layout:
`{root}/{job_id}/v{version}/` (the full form) or `v{version}.delta/` (the delta), each with
`manifest.json` (what the chunks must hash to), `chunks/{i}` (verified chunks, deleted after assembly)
and `model/` (the assembled files, `model/manifest.json` written last by `echo2.snapshots.assemble`):
for the full form the HF folder the backend loads, for a delta its payload, which `rebuilt/` holds the
HF folder made from (`echo2.deltas.apply_delta`, which checks every file and writes its marker last).
Nothing unverified is ever written under `chunks/`, `model/` or `rebuilt/`. Base models that LoRA
adapters apply to are also kept in `{root}/_shared/{digest}/` (hard links), so a worker fetches a base
once for every job on it.

Each running worker has a root of its own: two `echo2-worker join` on one machine share a --data-dir, and each
deletes every version it does not need. A store claims `{data_dir}/versions` with a lock held while it runs
(released when the process ends, however it ends), or, taken, the first free of `versions-2`, `versions-3`, ...;
a restarted worker takes over whichever folder is free, and what its job does not need is swept.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from echo2.deltas import Folder
from echo2.protocol import FileInfo, FileRef, Form, Manifest
from echo2.snapshots import SnapshotError, assemble, atomic_write, replace_dir, verify_chunk

log = logging.getLogger(__name__)
_SAFE_ID = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
_FOLDER = re.compile(r"^v(\d{1,8})(\.delta)?$")
_SUFFIX = {Form.full: "", Form.delta: ".delta"}
SHARED = "_shared"  # base models LoRA jobs share, by digest
CLAIM = "claim.lock"  # in a root: locked by the process whose store keeps its versions there


class HeldVersion:
    """One version of one job: which chunks are here, and a condition to wait for the others."""

    def __init__(self, job_id: str, manifest: Manifest, path: Path) -> None:
        self.job_id = job_id
        self.manifest = manifest
        self.version, self.form = manifest.version, manifest.form
        self.relay_key: str | None = None  # what children must present; None: serve it to no one
        self.path = path
        self.model_dir = path / "model"
        self.rebuilt_dir = path / "rebuilt"  # a delta's HF folder, once applied
        self._chunk_dir = path / "chunks"
        self._cond = threading.Condition()
        self._take_stock()

    @property
    def num_chunks(self) -> int:
        return len(self._held)

    def has(self, index: int) -> bool:
        return 0 <= index < len(self._held) and self._held[index]

    def missing(self) -> list[int]:
        return [i for i, held in enumerate(self._held) if not held]

    def held_count(self) -> int:
        return sum(self._held)

    def wait_for(self, index: int, timeout: float) -> bool:
        """Wait up to `timeout` seconds for chunk `index` to arrive (pipelined relaying)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.has(index), timeout=timeout)

    def put(self, index: int, data: bytes) -> None:
        """Store a chunk after checking it against the manifest (raises SnapshotError otherwise)."""
        verify_chunk(self.manifest, index, data)
        if self.has(index):
            return
        self._chunk_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self._chunk_dir / str(index), data)
        with self._cond:
            self._held[index] = True
            self._cond.notify_all()

    def read(self, index: int) -> bytes:
        """A held chunk's bytes: from `chunks/` while arriving, from the assembled files afterwards."""
        if not self.has(index):
            raise KeyError(index)
        if not self.complete:
            try:
                return (self._chunk_dir / str(index)).read_bytes()
            except FileNotFoundError:
                if not self.complete:  # deleted by assembly in between: read the folder instead
                    raise
        return self._read_assembled(index)

    def adopt(self, folder: Path) -> bool:
        """Take the files of an identical folder (a base model held for another job) instead of downloading
        them: hard links, each file checked against this manifest. False when they do not match."""
        tmp = self.path / "adopting"
        shutil.rmtree(tmp, ignore_errors=True)
        for f in self.manifest.files:
            src, dst = folder / f.path, tmp / f.path
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                return False
            if _sha256(dst) != f.sha256:
                shutil.rmtree(tmp, ignore_errors=True)
                return False
        atomic_write(tmp / "manifest.json", self.manifest.model_dump_json().encode())
        replace_dir(tmp, self.model_dir)
        with self._cond:
            self.complete, self._held = True, [True] * len(self._held)
            self._cond.notify_all()
        return True

    def loadable(self) -> Folder | None:
        """The HF folder of this version, once there is one: the full form's assembled folder, or the
        folder a delta rebuilt."""
        if self.form is Form.full:
            return Folder(self.version, self.model_dir, self.manifest.target_files()) if self.complete else None
        if self.complete and _intact(self.rebuilt_dir, self.manifest, self.manifest.target_files()):
            return Folder(self.version, self.rebuilt_dir, self.manifest.target_files())
        return None

    def assemble(self) -> Path:
        """Write the HF folder from the verified chunks (files checked whole), then drop the chunks."""
        if self.complete:
            return self.model_dir
        if self.missing():
            raise SnapshotError(f"version {self.version}: {len(self.missing())} chunks still missing")
        shutil.rmtree(self.model_dir, ignore_errors=True)
        try:
            assemble(self.manifest, lambda i: (self._chunk_dir / str(i)).read_bytes(), self.model_dir)
        except FileNotFoundError:  # a chunk deleted behind this process (by hand, a cleanup): fetched again next
            self._take_stock()
            raise
        self.complete = True
        shutil.rmtree(self._chunk_dir, ignore_errors=True)
        return self.model_dir

    def _read_assembled(self, index: int) -> bytes:
        info = self.manifest.chunks[index]
        start, end = index * self.manifest.chunk_size, index * self.manifest.chunk_size + info.size
        out = bytearray()
        for f in self.manifest.files:
            lo, hi = max(start, f.offset), min(end, f.offset + f.size)
            if lo >= hi:
                continue
            with open(self.model_dir / f.path, "rb") as fh:
                fh.seek(lo - f.offset)
                out += fh.read(hi - lo)
        return bytes(out)

    def _take_stock(self) -> None:
        """What is on disk: the assembled folder (each file of the size the manifest says: one cut short while the
        worker was down is not loaded), else the chunks that still verify (after a restart, or chunks that vanished)."""
        self.complete = _intact(self.model_dir, self.manifest, self.manifest.files)
        self._held = [self.complete] * len(self.manifest.chunks)
        if not self.complete:
            self._recover_chunks()

    def _recover_chunks(self) -> None:
        """Keep the chunks on disk that still verify."""
        if not self._chunk_dir.is_dir():
            return
        for entry in self._chunk_dir.iterdir():
            if not entry.name.isdigit() or int(entry.name) >= len(self._held):
                entry.unlink(missing_ok=True)
                continue
            try:
                verify_chunk(self.manifest, int(entry.name), entry.read_bytes())
                self._held[int(entry.name)] = True
            except (OSError, SnapshotError):
                entry.unlink(missing_ok=True)


class VersionStore:
    """Every version held on disk, by (job, version); the relay server and the downloader share it."""

    def __init__(self, root: Path) -> None:
        self.root, self._claim = _claim(Path(root))
        self._versions: dict[tuple[str, int, Form], HeldVersion] = {}
        self._lock = threading.Lock()

    def get(self, job_id: str, version: int, form: Form = Form.full) -> HeldVersion | None:
        with self._lock:
            return self._versions.get((job_id, version, form))

    def loadable(self, job_id: str, version: int) -> Folder | None:
        """The HF folder of a version, in whichever form it arrived."""
        for form in Form:
            held = self.get(job_id, version, form)
            if held is not None and (folder := held.loadable()) is not None:
                return folder
        return None

    def weights(self, job_id: str, version: int) -> tuple[Path, Path | None] | None:
        """What a backend loads for a version: (model folder, adapter folder or None); None until every
        part is here (a LoRA adapter needs its base)."""
        folder = self.loadable(job_id, version)
        if folder is None:
            return None
        base_version = self.adapter_base(job_id, version)
        if base_version is None:
            return folder.path, None
        base = self.loadable(job_id, base_version)
        return (base.path, folder.path) if base is not None else None

    def adapter_base(self, job_id: str, version: int) -> int | None:
        """The base version a held LoRA adapter version applies to (None for a model version)."""
        held = self.get(job_id, version)
        return held.manifest.adapter.base_version if held is not None and held.manifest.adapter else None

    def shared(self, digest: str) -> Path | None:
        """A base model kept for every job on it, by the digest of its files (echo2.deltas.files_digest)."""
        folder = self.root / SHARED / digest
        if not folder.is_dir():
            return None
        folder.touch()  # recently used: kept
        return folder

    def share(self, digest: str, folder: Path, keep: int = 2) -> None:
        """Keep `folder` (hard links) as the base with this digest; only the `keep` most recently used stay."""
        target = self.root / SHARED / digest
        if target.is_dir():
            return
        tmp = target.with_name(f"{digest}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(folder, tmp, copy_function=os.link)
        replace_dir(tmp, target)
        kept = sorted((d for d in target.parent.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime)
        for old in kept[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    def held(self, job_id: str) -> list[int]:
        """The job's versions that have a loadable folder, ascending."""
        return sorted({v.version for v in self.versions(job_id) if v.loadable() is not None})

    def damaged(self, job_id: str, version: int) -> list[int]:
        """The version, and its LoRA base, when a file of its folder does not hash to its manifest (after a failed
        load: damage that kept the files' sizes)."""
        parts = [version] + [b for b in [self.adapter_base(job_id, version)] if b is not None]
        return [v for v in parts if (folder := self.loadable(job_id, v)) is not None
                and not all(_hashes_to(folder.path / f.path, f.sha256) for f in folder.files)]

    def drop(self, job_id: str, version: int) -> None:
        """Forget a version (both forms) and delete it from disk: e.g. a base a delta did not match."""
        with self._lock:
            for form in Form:
                self._versions.pop((job_id, version, form), None)
        for form in Form:
            shutil.rmtree(self.root / job_id / f"v{version}{_SUFFIX[form]}", ignore_errors=True)

    def open(self, job_id: str, manifest: Manifest, relay_key: str | None = None) -> HeldVersion:
        """The version's entry, created (or resumed from disk) for this manifest; `relay_key` (from the
        assignment, kept in memory only) is what the relay server will ask children for."""
        if not _SAFE_ID.match(job_id):
            raise ValueError(f"unsafe job id {job_id!r}")
        key = (job_id, manifest.version, manifest.form)
        with self._lock:
            held = self._versions.get(key)
            if held is not None:
                if _digest(held.manifest) != _digest(manifest):
                    raise SnapshotError(f"version {manifest.version} of {job_id} changed its manifest")
                held.relay_key = relay_key or held.relay_key
                return held
            path = self.root / job_id / f"v{manifest.version}{_SUFFIX[manifest.form]}"
            saved = path / "manifest.json"
            if saved.exists() and saved.read_bytes() != manifest.model_dump_json().encode():
                shutil.rmtree(path, ignore_errors=True)  # another job database or a bad run: start over
            path.mkdir(parents=True, exist_ok=True)
            atomic_write(saved, manifest.model_dump_json().encode())
            held = HeldVersion(job_id, manifest, path)
            held.relay_key = relay_key
            self._versions[key] = held
            return held

    def close(self) -> None:
        """Release the root for the next store (a restarted worker); the process's end does it too."""
        self._claim.close()

    def versions(self, job_id: str) -> list[HeldVersion]:
        with self._lock:
            return sorted((v for (j, _, _), v in self._versions.items() if j == job_id), key=lambda v: v.version)

    def keep_only(self, job_id: str | None, versions: set[int]) -> list[int]:
        """Delete every version not in `versions` of `job_id`, both forms (and everything of other jobs)."""
        with self._lock:
            doomed = [k for k in self._versions if k[0] != job_id or k[1] not in versions]
            for key in doomed:
                del self._versions[key]
        for job, version, form in doomed:
            shutil.rmtree(self.root / job / f"v{version}{_SUFFIX[form]}", ignore_errors=True)
        self._sweep_disk(job_id, versions)
        return sorted({v for j, v, _ in doomed if j == job_id})

    def _sweep_disk(self, job_id: str | None, keep: set[int]) -> None:
        """Delete leftovers of earlier runs that this run never opened and does not want."""
        for job_dir in [d for d in self.root.iterdir() if d.is_dir() and d.name != SHARED]:
            for vdir in [d for d in job_dir.iterdir() if d.is_dir()]:
                m = _FOLDER.match(vdir.name)
                version, form = (int(m.group(1)), Form.delta if m.group(2) else Form.full) if m else (-1, Form.full)
                with self._lock:
                    opened = (job_dir.name, version, form) in self._versions
                if not opened and not (job_dir.name == job_id and version in keep):
                    shutil.rmtree(vdir, ignore_errors=True)
            if not any(job_dir.iterdir()):
                job_dir.rmdir()


def _claim(root: Path) -> tuple[Path, BinaryIO]:
    """`root`, or the first of `root-2`, `root-3`, ... that no other process holds, and its lock (kept open)."""
    folder, n = root, 1
    while True:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / CLAIM, "ab")  # noqa: SIM115 (held open for the store's life: the lock goes with it)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            n += 1
            folder = root.with_name(f"{root.name}-{n}")
            continue
        if folder != root:
            log.info("%s is in use by another worker on this machine: keeping versions in %s", root, folder)
        return folder, lock


def _intact(folder: Path, manifest: Manifest, files: Sequence[FileInfo | FileRef]) -> bool:
    """The folder was completed for this manifest (its marker) and every file is still of its size."""
    try:
        return _marker_matches(folder, manifest) and all((folder / f.path).stat().st_size == f.size for f in files)
    except OSError:
        return False


def _marker_matches(folder: Path, manifest: Manifest) -> bool:
    try:
        marker = Manifest.model_validate_json((folder / "manifest.json").read_bytes())
    except (OSError, ValueError):
        return False
    return [c.sha256 for c in marker.chunks] == [c.sha256 for c in manifest.chunks]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _hashes_to(path: Path, sha256: str) -> bool:
    try:
        return _sha256(path) == sha256
    except OSError:
        return False


def _digest(manifest: Manifest) -> str:
    return hashlib.sha256("".join(c.sha256 for c in manifest.chunks).encode()).hexdigest()

