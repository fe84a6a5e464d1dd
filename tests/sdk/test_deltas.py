"""Delta versions: what changed since the base travels, and the rebuilt folder is bit-identical to the
learner's or is refused before anyone loads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from echo2.deltas import DeltaError, Folder, apply_delta, build_delta, file_refs
from echo2.protocol import Manifest
from safetensors.torch import save_file


def weights_folder(path: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config or {"model_type": "qwen2"}))
    return path


def bf16_step(base: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    """One Adam-like step kept in fp32, published in bf16: most bf16 elements do not change."""
    gen = torch.Generator().manual_seed(seed)
    return {k: (v.float() - lr * torch.sign(torch.randn(v.shape, generator=gen))).to(torch.bfloat16)
            for k, v in base.items()}


def folder(path: Path, version: int) -> Folder:
    return Folder(version, path, file_refs(path))


def delta_manifest(base: Path, target: Path, out: Path) -> Manifest:
    manifest = build_delta(folder(base, 0), folder(target, 1), out, step=1, chunk_size=4096)
    assert manifest is not None
    return manifest


@pytest.fixture
def versions(tmp_path):
    gen = torch.Generator().manual_seed(0)
    v0 = {"w": (torch.randn(256, 256, generator=gen) * 0.02).to(torch.bfloat16),
          "b": torch.zeros(256, dtype=torch.bfloat16)}
    v1 = bf16_step(v0, 2e-6, seed=1)
    return weights_folder(tmp_path / "v0", v0), weights_folder(tmp_path / "v1", v1)


def test_a_delta_rebuilds_the_target_bit_for_bit_and_is_small(tmp_path, versions):
    v0, v1 = versions
    manifest = delta_manifest(v0, v1, tmp_path / "d1")
    assert [f.path for f in manifest.files] == ["model.safetensors.sparse.zst"]  # config.json did not change
    full = sum(f.size for f in file_refs(v1))
    assert manifest.total_size < 0.2 * full
    out = apply_delta(manifest, tmp_path / "d1", folder(v0, 0), tmp_path / "rebuilt")
    for ref in file_refs(v1):
        assert (out / ref.path).read_bytes() == (v1 / ref.path).read_bytes()
    assert Manifest.model_validate_json((out / "manifest.json").read_text()) == manifest


def test_a_changed_config_travels_whole(tmp_path, versions):
    v0, v1 = versions
    (v1 / "config.json").write_text(json.dumps({"model_type": "qwen2", "note": "a longer config file"}))
    manifest = delta_manifest(v0, v1, tmp_path / "d1")
    assert sorted(f.path for f in manifest.files) == ["config.json.zst", "model.safetensors.sparse.zst"]
    out = apply_delta(manifest, tmp_path / "d1", folder(v0, 0), tmp_path / "rebuilt")
    assert (out / "config.json").read_bytes() == (v1 / "config.json").read_bytes()


def test_the_wrong_base_is_refused_before_anything_is_written(tmp_path, versions):
    v0, v1 = versions
    manifest = delta_manifest(v0, v1, tmp_path / "d1")
    other = weights_folder(tmp_path / "other", {"w": torch.ones(256, 256, dtype=torch.bfloat16),
                                                 "b": torch.zeros(256, dtype=torch.bfloat16)})
    with pytest.raises(DeltaError, match="not the base this delta was made against"):
        apply_delta(manifest, tmp_path / "d1", folder(other, 0), tmp_path / "rebuilt")
    assert not (tmp_path / "rebuilt").exists()


def test_a_base_that_changed_on_disk_or_a_wrong_target_hash_fails_the_check(tmp_path, versions):
    v0, v1 = versions
    manifest = delta_manifest(v0, v1, tmp_path / "d1")
    held = folder(v0, 0)  # what the worker verified when it got v0
    data = bytearray((v0 / "model.safetensors").read_bytes())
    data[-1] ^= 0x01  # one bit of the base flipped on disk afterwards
    (v0 / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(DeltaError, match="does not match the sha256"):
        apply_delta(manifest, tmp_path / "d1", held, tmp_path / "rebuilt")
    assert not (tmp_path / "rebuilt" / "manifest.json").exists()
    assert not (tmp_path / "rebuilt" / "model.safetensors").exists()


def test_a_corrupt_or_oversized_payload_is_refused(tmp_path, versions):
    import zstandard

    v0, v1 = versions
    manifest = delta_manifest(v0, v1, tmp_path / "d1")
    payload = tmp_path / "d1" / "model.safetensors.sparse.zst"
    payload.write_bytes(b"not zstd at all")
    with pytest.raises(DeltaError, match="corrupt zstd payload"):
        apply_delta(manifest, tmp_path / "d1", folder(v0, 0), tmp_path / "rebuilt")
    size = (v1 / "model.safetensors").stat().st_size
    payload.write_bytes(zstandard.ZstdCompressor().compress(b"\0" * (size + 10_000_000)))  # a bomb
    with pytest.raises(DeltaError):
        apply_delta(manifest, tmp_path / "d1", folder(v0, 0), tmp_path / "rebuilt")


def test_a_sparse_patch_is_sized_by_the_words_that_changed(tmp_path):
    """k changed bf16 words cost about 6k bytes before compression, whatever the file's size; a file where
    more than an eighth of the words changed goes as XOR + zstd instead; both rebuild bit for bit."""
    gen = torch.Generator().manual_seed(0)
    v0 = {"w": (torch.randn(1024, 1024, generator=gen) * 0.02).to(torch.bfloat16)}
    sparse = {"w": v0["w"].clone()}
    sparse["w"].view(-1)[::1000] += 1.0  # 1,049 of 1,048,576 words
    dense = {"w": (v0["w"].float() * 1.01).to(torch.bfloat16)}  # most words
    base = weights_folder(tmp_path / "v0", v0)
    for name, tensors, form in (("sparse", sparse, ".sparse.zst"), ("dense", dense, ".xor.zst")):
        target = weights_folder(tmp_path / name, tensors)
        manifest = delta_manifest(base, target, tmp_path / f"d-{name}")
        assert [f.path for f in manifest.files] == ["model.safetensors" + form]
        if name == "sparse":
            assert manifest.total_size < 6 * 1049 + 100
        out = apply_delta(manifest, tmp_path / f"d-{name}", folder(base, 0), tmp_path / f"rebuilt-{name}")
        assert (out / "model.safetensors").read_bytes() == (target / "model.safetensors").read_bytes()


def test_a_forged_sparse_patch_is_refused(tmp_path, versions):
    import zstandard
    from echo2.deltas import SPARSE_MAGIC

    v0, v1 = versions
    manifest = delta_manifest(v0, v1, tmp_path / "d1")
    payload = tmp_path / "d1" / "model.safetensors.sparse.zst"
    size = (v1 / "model.safetensors").stat().st_size
    outside = SPARSE_MAGIC + (1).to_bytes(8, "little") + (size).to_bytes(4, "little") + b"\x01\x00"
    short = SPARSE_MAGIC + (5).to_bytes(8, "little") + b"\x01" * 7
    for forged in (outside, short):
        payload.write_bytes(zstandard.ZstdCompressor().compress(forged))
        with pytest.raises(DeltaError, match="patch"):
            apply_delta(manifest, tmp_path / "d1", folder(v0, 0), tmp_path / "rebuilt")
