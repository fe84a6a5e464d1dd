"""Checkpoint download safety: hostile or corrupt tars are refused and leave nothing behind.

The control plane only ever sends good tars, so these come from the scripted local server.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import tarfile
from datetime import UTC, datetime

import pytest
from echo2 import AsyncClient, CheckpointError, Client
from echo2.protocol import Manifest

from .stub import Reply


def _tar(*members: tuple[tarfile.TarInfo, bytes], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for info, data in members:
            info.size = len(data) if info.isfile() else 0
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return buf.getvalue()


def _file(name: str, data: bytes = b"weights") -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, b""


def _tar_reply(body: bytes, version: int | None = None) -> Reply:
    headers = {}
    if version is not None:
        headers["content-disposition"] = f'attachment; filename="j-v{version}.tar"'
    return Reply(200, body, headers, "application/x-tar")


HOSTILE = {
    "parent traversal": _tar(_file("config.json"), _file("../escaped.txt")),
    "nested traversal": _tar(_file("sub/../../escaped.txt")),
    "absolute path": _tar(_file("/tmp/echo2-escaped.txt")),
    "long pax path": _tar(_file("../" + "d" * 120 + "/escaped.txt")),
    "gnu long name": _tar(_file("../" + "g" * 120 + "/escaped.txt"), fmt=tarfile.GNU_FORMAT),
    "symlink": _tar(_link("model.safetensors", "/etc/passwd")),
    "hard link": _tar(_file("a.json"), _link("b.json", "/etc/passwd", tarfile.LNKTYPE)),
    "device": _tar((lambda i: (setattr(i, "type", tarfile.CHRTYPE), (i, b""))[1])(tarfile.TarInfo("dev"))),
    "truncated": _tar(_file("model.safetensors", b"x" * 5000))[:2048],
    "garbage": b"this is not a tar archive at all" * 40,
    "empty": _tar(),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_tar_is_refused_and_leaves_nothing(stub, tmp_path, case):
    stub.reply(_tar_reply(HOSTILE[case]))
    dest = tmp_path / "out" / "model"
    with Client(stub.url, "k") as client, pytest.raises(CheckpointError):
        client.checkpoints.download("j", dest)
    assert not dest.exists()
    assert [p.name for p in (tmp_path / "out").iterdir()] == []
    assert not list(tmp_path.rglob("escaped.txt")) and not (tmp_path.parent / "escaped.txt").exists()


def test_async_download_refuses_traversal_too(stub, tmp_path):
    stub.reply(_tar_reply(HOSTILE["parent traversal"]))

    async def main() -> None:
        async with AsyncClient(stub.url, "k") as client:
            await client.checkpoints.download("j", tmp_path / "model")

    with pytest.raises(CheckpointError, match="escape"):
        asyncio.run(main())
    assert list(tmp_path.iterdir()) == []


def _manifest(files: dict[str, bytes]) -> bytes:
    offset, infos = 0, []
    for path, data in files.items():
        infos.append({"path": path, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                      "offset": offset})
        offset += len(data)
    blob = b"".join(files.values())
    pieces = [blob[s:s + 4096] for s in range(0, offset, 4096)]
    manifest = Manifest.model_validate({
        "version": 3, "step": 3, "chunk_size": 4096, "total_size": offset, "files": infos,
        "chunks": [{"index": i, "size": len(p), "sha256": hashlib.sha256(p).hexdigest()}
                   for i, p in enumerate(pieces)],
        "created_at": datetime.now(UTC).isoformat(),
    })
    return manifest.model_dump_json().encode()


def test_files_are_checked_against_the_manifest(stub, tmp_path):
    good = {"config.json": b'{"a": 1}', "model.safetensors": b"w" * 10_000}
    manifest = Reply(200, _manifest(good))
    with Client(stub.url, "k") as client:
        stub.reply(_tar_reply(_tar(*(_file(n, d) for n, d in good.items())), version=3), manifest)
        dest = client.checkpoints.download("j", tmp_path / "ok")
        assert {p.name: p.read_bytes() for p in dest.iterdir()} == good
        assert [s.path for s in stub.seen] == ["/v1/jobs/j/checkpoint", "/v1/jobs/j/versions/3/manifest"]
        weights = _file("model.safetensors", good["model.safetensors"])
        config = _file("config.json", good["config.json"])
        cases = {
            "sha256": _tar(_file("config.json", b'{"a": 2}'), weights),
            "bytes": _tar(_file("config.json", b'{"a": 10}'), weights),
            "not in the version's manifest": _tar(config, weights, _file("extra.json")),
            "missing": _tar(config),
            "twice": _tar(config, _file("./config.json", good["config.json"])),
        }
        for message, body in cases.items():
            stub.reply(_tar_reply(body, version=3), manifest)
            with pytest.raises(CheckpointError, match=message):
                client.checkpoints.download("j", tmp_path / "bad")
            assert not (tmp_path / "bad").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]


def test_directories_and_nested_files_are_extracted(stub, tmp_path):
    folder = tarfile.TarInfo("tokenizer")
    folder.type = tarfile.DIRTYPE
    body = _tar((folder, b""), _file("tokenizer/vocab.json", b"{}"), _file("./model.safetensors", b""))
    stub.reply(_tar_reply(body))
    with Client(stub.url, "k") as client:
        dest = client.checkpoints.download("j", tmp_path / "m")
    assert (dest / "tokenizer" / "vocab.json").read_bytes() == b"{}"
    assert (dest / "model.safetensors").read_bytes() == b""
