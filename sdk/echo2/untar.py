"""Checkpoint downloads made safe: a streamed tar extracted as it arrives into a staging folder that
replaces the destination only when complete.

`TarSink` is push-fed (the same code serves the sync and the async download, without buffering the
tar): it writes only plain files and folders inside its root, refuses links, devices and paths that
would escape, and checks every file against the version's manifest (size and sha256). `Staging` is the
folder beside the destination that `commit()` moves into place; anything else removes it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tarfile
import uuid
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any

from .errors import CheckpointError
from .protocol import Manifest

__all__ = ["Staging", "TarSink", "check_dest"]


def check_dest(dest: Path, overwrite: bool) -> Path:
    if dest.exists():
        if not dest.is_dir():
            raise CheckpointError(f"{dest} exists and is not a folder")
        if not overwrite and any(dest.iterdir()):
            raise CheckpointError(f"{dest} is not empty; pass overwrite=True (--overwrite) to replace")
    return dest


class Staging:
    """A fresh folder beside `dest`; `commit()` moves it into place, anything else removes it."""

    def __init__(self, dest: Path, overwrite: bool) -> None:
        self.dest, self.overwrite = dest, overwrite
        self.path = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"

    def __enter__(self) -> Staging:
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        self.path.mkdir()
        return self

    def commit(self) -> None:
        old: Path | None = None
        if self.dest.exists():
            check_dest(self.dest, self.overwrite)
            old = self.dest.parent / f".{self.dest.name}.old-{uuid.uuid4().hex[:8]}"
            self.dest.rename(old)
        self.path.rename(self.dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.path.exists():
            shutil.rmtree(self.path, ignore_errors=True)


_BLOCK = tarfile.BLOCKSIZE
_FILE_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)


def _safe_relpath(name: str) -> str:
    """The member's path relative to the folder, or CheckpointError if it could land outside it."""
    if not name or "\0" in name or "\\" in name or name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise CheckpointError(f"refusing checkpoint entry {name!r}: absolute or invalid path")
    parts = [p for p in PurePosixPath(name).parts if p != "."]
    if not parts or ".." in parts:
        raise CheckpointError(f"refusing checkpoint entry {name!r}: it would escape the folder")
    return "/".join(parts)


class TarSink:
    """A push-fed tar reader that writes only plain files and folders, inside `root`, as bytes arrive.

    Push-fed so the same code serves the sync and the async download without buffering the tar.
    Understands ustar, pax (`x`/`g`) and GNU long-name headers; refuses links and devices.
    """

    def __init__(self, root: Path, manifest: Manifest | None) -> None:
        self.root = root
        self.real_root = os.path.realpath(root)
        self.expected = {f.path: f for f in manifest.files} if manifest is not None else None
        self.buf = bytearray()
        self.done = False
        self.skip = 0
        self.meta: tuple[str, int] | None = None  # (header kind, size) of a pax/long-name body being read
        self.pax: dict[str, str] = {}
        self.long_name: str | None = None
        self.file: Any = None
        self.file_left = 0
        self.file_path = ""
        self.hasher: Any = None
        self.written: dict[str, str] = {}

    def feed(self, data: bytes) -> None:
        self.buf += data
        while self._step():
            pass

    def _step(self) -> bool:
        """Consume what can be consumed now; False when more bytes are needed."""
        if self.file is not None:
            return self._write_file()
        if self.skip:
            n = min(self.skip, len(self.buf))
            del self.buf[:n]
            self.skip -= n
            return n > 0
        if self.meta is not None:
            return self._read_meta()
        if self.done:
            if self.buf.strip(b"\0"):
                raise CheckpointError("checkpoint tar has data after its end marker")
            self.buf.clear()
            return False
        if len(self.buf) < _BLOCK:
            return False
        block = bytes(self.buf[:_BLOCK])
        del self.buf[:_BLOCK]
        if block == b"\0" * _BLOCK:
            self.done = True
            return True
        self._header(block)
        return True

    def _header(self, block: bytes) -> None:
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:
            raise CheckpointError(f"checkpoint tar is corrupt: {exc}") from None
        if info.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME):
            if info.size > 1 << 20:
                raise CheckpointError("checkpoint tar has an oversized metadata header")
            self.meta = (info.type.decode(), info.size)
            return
        name = self.pax.pop("path", None) or self.long_name or info.name
        size = int(self.pax.pop("size", info.size))
        self.pax, self.long_name = {}, None
        rel = _safe_relpath(name)
        if info.type == tarfile.DIRTYPE:
            self._target(rel).mkdir(parents=True, exist_ok=True)
            self.skip = _padded(size)
        elif info.type in _FILE_TYPES:
            self._open(rel, size)
        else:
            kind = {tarfile.SYMTYPE: "symlink", tarfile.LNKTYPE: "hard link"}.get(info.type, "special file")
            raise CheckpointError(f"refusing checkpoint entry {name!r}: a {kind}, not a plain file")

    def _read_meta(self) -> bool:
        assert self.meta is not None
        kind, size = self.meta
        if len(self.buf) < _padded(size):
            return False
        body = bytes(self.buf[:size])
        del self.buf[:_padded(size)]
        self.meta = None
        if kind == tarfile.GNUTYPE_LONGNAME.decode():
            self.long_name = body.rstrip(b"\0").decode("utf-8", "surrogateescape")
        elif kind == tarfile.XHDTYPE.decode():
            self.pax = _pax_records(body)
        return True  # a global pax header (g) carries nothing we use

    def _target(self, rel: str) -> Path:
        target = self.root / rel
        real = os.path.realpath(target)
        if os.path.commonpath([real, self.real_root]) != self.real_root:
            raise CheckpointError(f"refusing checkpoint entry {rel!r}: it would escape the folder")
        return target

    def _open(self, rel: str, size: int) -> None:
        if self.expected is not None:
            info = self.expected.get(rel)
            if info is None:
                raise CheckpointError(f"checkpoint entry {rel!r} is not in the version's manifest")
            if info.size != size:
                raise CheckpointError(
                    f"checkpoint entry {rel!r} has {size} bytes, the manifest says {info.size}")
        if rel in self.written:
            raise CheckpointError(f"checkpoint has {rel!r} twice")
        target = self._target(rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(target, "xb")  # noqa: SIM115 - closed in _finish_file; "x" never follows a planted link
        self.file_left, self.file_path, self.hasher = size, rel, hashlib.sha256()
        self.skip = 0
        if size == 0:
            self._finish_file()

    def _write_file(self) -> bool:
        n = min(self.file_left, len(self.buf))
        if n == 0:
            return False
        piece = bytes(self.buf[:n])
        del self.buf[:n]
        self.file.write(piece)
        self.hasher.update(piece)
        self.file_left -= n
        if self.file_left == 0:
            self._finish_file()
        return True

    def _finish_file(self) -> None:
        size = self.file.tell()
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        self.file = None
        digest = self.hasher.hexdigest()
        if self.expected is not None and self.expected[self.file_path].sha256 != digest:
            raise CheckpointError(
                f"checkpoint file {self.file_path!r} does not match the manifest's sha256")
        self.written[self.file_path] = digest
        self.skip = _padded(size) - size

    def __enter__(self) -> TarSink:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.file is not None:  # a failed download: the staging folder is removed next
            self.file.close()
            self.file = None

    def finish(self) -> None:
        """The stream ended: check that the tar was complete and every manifest file arrived."""
        if self.file is not None:
            raise CheckpointError(f"checkpoint download ended inside {self.file_path!r}")
        if not self.done:
            raise CheckpointError("checkpoint download ended before the end of the tar")
        if self.expected is not None:
            missing = sorted(set(self.expected) - set(self.written))
            if missing:
                raise CheckpointError(f"checkpoint is missing {', '.join(missing[:5])}")
        if not self.written:
            raise CheckpointError("checkpoint has no files")


def _padded(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK


def _pax_records(body: bytes) -> dict[str, str]:
    """Parse pax extended-header records: `<len> <key>=<value>\\n`, len counting the whole record."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(body):
        space = body.find(b" ", pos)
        if space < 0 or not body[pos:space].isdigit():
            raise CheckpointError("checkpoint tar has a corrupt pax header")
        length = int(body[pos:space])
        record = body[space + 1:pos + length]
        if length <= 0 or not record.endswith(b"\n") or b"=" not in record:
            raise CheckpointError("checkpoint tar has a corrupt pax header")
        key, _, value = record[:-1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out
