"""A version's manifest, hashed in one read of its folder, names every file and chunk as they are."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from echo2.snapshots import assemble, build_manifest, iter_stream
from safetensors.torch import save_file


@pytest.mark.parametrize("chunk_size", [4096, 3 * 2**20 + 123])
def test_one_read_hashes_every_file_and_chunk(tmp_path, chunk_size):
    folder = tmp_path / "v"
    folder.mkdir()
    save_file({"w": torch.randn(1100, 1000)}, str(folder / "model.safetensors"))  # 4.4 MB: several 1 MiB blocks
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    manifest = build_manifest(folder, version=3, step=3, chunk_size=chunk_size)
    assert [f.path for f in manifest.files] == ["config.json", "model.safetensors"]
    assert [f.sha256 for f in manifest.files] == [hashlib.sha256((folder / f.path).read_bytes()).hexdigest()
                                                  for f in manifest.files]
    pieces = list(iter_stream(folder, manifest.files, chunk_size))
    assert [c.sha256 for c in manifest.chunks] == [hashlib.sha256(p).hexdigest() for p in pieces]
    assert [c.size for c in manifest.chunks] == [len(p) for p in pieces] and len(pieces) > 1
    assert manifest.total_size == sum(len(p) for p in pieces)
    out = assemble(manifest, lambda i: pieces[i], tmp_path / "out")
    assert (out / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
