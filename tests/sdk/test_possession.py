"""echo2.possession: probes of a version's files as one stream, and the answers a copy gives."""

import hashlib

import pytest
from echo2.deltas import Folder, file_refs
from echo2.possession import answer, draw_probes, read_range
from echo2.protocol import Challenge


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "v1"
    root.mkdir()
    (root / "a.bin").write_bytes(bytes(range(256)) * 20)  # 5120 bytes
    (root / "b.bin").write_bytes(b"\x07" * 3000)
    return root


def test_a_range_reads_across_files_in_manifest_order(folder):
    files = file_refs(folder, [folder / "a.bin", folder / "b.bin"])
    stream = (folder / "a.bin").read_bytes() + (folder / "b.bin").read_bytes()
    assert read_range(folder, files, 5000, 300) == stream[5000:5300]
    with pytest.raises(ValueError, match="not all in the version"):
        read_range(folder, files, 8000, 200)


def test_an_honest_copy_answers_every_probe(folder, tmp_path):
    files = file_refs(folder, [folder / "a.bin", folder / "b.bin"])
    probes = draw_probes(folder, files)
    assert len(probes) == 32 and all(p.length == 4096 for p in probes)
    assert len({p.offset for p in probes}) > 1  # drawn, not fixed
    for p in probes:
        proof = answer(folder, files, Challenge(version=1, offset=p.offset, length=p.length))
        assert proof.sha256 == p.sha256 == hashlib.sha256(read_range(folder, files, p.offset, p.length)).hexdigest()


def test_probes_avoid_what_the_base_has_unless_nothing_changed(folder, tmp_path):
    files = file_refs(folder, [folder / "a.bin", folder / "b.bin"])
    base = tmp_path / "v0"
    base.mkdir()
    (base / "a.bin").write_bytes((folder / "a.bin").read_bytes())  # only b.bin changed
    (base / "b.bin").write_bytes(b"\x00" * 3000)
    probes = draw_probes(folder, files, Folder(0, base, file_refs(base, [base / "a.bin", base / "b.bin"])))
    assert all(p.offset + p.length > 5120 for p in probes)  # each reaches into b.bin
    same = draw_probes(folder, files, Folder(0, folder, files))  # holding the base is holding it
    assert len(same) == 32
