"""The worker's versions on disk (echo2_worker.store), shared by two `echo2-worker join` on one machine.

The join refuses to replace a saved worker that another process runs and tells the provider to "give this one a
--config-dir of its own, or pass --new to register a second worker beside it" (cli._alive). Either way both
processes keep their weights under the same --data-dir (config.default_data_dir, whatever --config-dir says). Each
process's VersionStore treated the other's versions as leftovers of an earlier run: the first swap of one worker
(Versions._gc -> VersionStore.keep_only -> _sweep_disk) deleted every version the other held or was downloading.
Each running store now keeps its versions in a folder of its own.

Also a weight cache damaged on disk between two runs of the worker. A file of a version cut short while the worker
was down (the disk filled while something else wrote, a provider's rsync or cleanup interrupted, a filesystem
repaired after a power cut) was taken on restart as a complete version: `HeldVersion` called it complete when
`model/manifest.json` matched the manifest, without looking at the files themselves, the download "resumed" with
nothing to fetch, and the backend was handed the damaged folder, at every restart.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from echo2.snapshots import build_manifest, iter_stream
from echo2_worker.fetch import Downloader
from echo2_worker.relay import RelayServer
from echo2_worker.store import VersionStore

from tests.conftest import Api

from .conftest import rollouts, start_job, start_worker, wait_for, worker_row

CHUNK = 16 * 1024
KEY = "k" * 64
JOB_A, JOB_B = "job_storea", "job_storeb"


def _complete(store: VersionStore, job: str, folder: Path, version: int = 0):
    manifest = build_manifest(folder, version, 0, CHUNK)
    held = store.open(job, manifest, KEY)
    for i, data in enumerate(iter_stream(folder, manifest.files, CHUNK)):
        held.put(i, data)
    held.assemble()
    return held, manifest


def test_a_second_worker_on_the_machine_does_not_delete_the_weights_the_first_one_runs_on(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    shared = tmp_path / "cache" / "versions"  # default_data_dir() / "versions", the same for both processes
    first, second = VersionStore(shared), VersionStore(shared)
    held_a, _ = _complete(first, JOB_A, tiny_model_dir)  # worker 1 loaded version 0 of job A
    assert first.weights(JOB_A, 0) is not None

    _complete(second, JOB_B, tiny_model_dir)  # worker 2, on job B, swaps in its version 0 ...
    second.keep_only(JOB_B, {0})  # ... and Versions._gc keeps what it needs

    model_dir, _ = first.weights(JOB_A, 0)  # worker 1 still believes it holds the version
    assert (model_dir / "model.safetensors").exists() or any(model_dir.glob("*.safetensors")), \
        "the other worker's swap deleted the weights this worker runs on, relays and proves possession from"
    held_a.read(0)  # what its relay serves its children


def test_a_download_interrupted_by_the_other_workers_sweep_still_completes(tmp_path: Path,
                                                                          tiny_model_dir: Path) -> None:
    origin_store = VersionStore(tmp_path / "origin")
    _, manifest = _complete(origin_store, JOB_A, tiny_model_dir)
    chunks = list(iter_stream(tiny_model_dir, manifest.files, CHUNK))
    shared = tmp_path / "cache" / "versions"
    first, second = VersionStore(shared), VersionStore(shared)

    # Worker 1 is part-way through version 0 of job A (half its chunks verified on disk) ...
    held = first.open(JOB_A, manifest, KEY)
    for i in range(len(chunks) // 2):
        held.put(i, chunks[i])
    # ... when worker 2 swaps in a version of its own job and sweeps the disk.
    _complete(second, JOB_B, tiny_model_dir)
    second.keep_only(JOB_B, {0})

    with RelayServer(origin_store) as origin:
        dl = Downloader(first, origin_token=KEY)
        try:
            failures = []
            for _ in range(2):  # Versions._download retries after a failure, on the same VersionStore
                try:
                    result = dl.fetch(JOB_A, manifest, [origin.url], relay_key=KEY)
                    break
                except OSError as exc:
                    failures.append(exc)
            else:
                pytest.fail(f"the download never completes: every retry fails with {failures[-1]!r} (chunks the "
                            "other worker deleted are still counted as held, so they are never fetched again)")
        finally:
            dl.close()
    assert result.held.complete


def test_a_chunk_deleted_behind_the_store_is_fetched_again(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A verified chunk that vanished from disk (a cleanup, by hand) failed every assembly: it was still counted as
    held, so never fetched again. The failed assembly takes stock of the disk, and the next fetch gets it."""
    origin_store = VersionStore(tmp_path / "origin")
    _, manifest = _complete(origin_store, JOB_A, tiny_model_dir)
    store = VersionStore(tmp_path / "versions")
    held = store.open(JOB_A, manifest, KEY)
    for i, data in enumerate(iter_stream(tiny_model_dir, manifest.files, CHUNK)):
        held.put(i, data)
    (held.path / "chunks" / "1").unlink()

    with RelayServer(origin_store) as origin:
        dl = Downloader(store, origin_token=KEY)
        try:
            with pytest.raises(FileNotFoundError):
                dl.fetch(JOB_A, manifest, [origin.url], relay_key=KEY)
            assert held.missing() == [1]
            assert dl.fetch(JOB_A, manifest, [origin.url], relay_key=KEY).held.complete
        finally:
            dl.close()


def test_a_restarted_worker_takes_over_the_folder_the_stopped_one_left(tmp_path: Path, tiny_model_dir: Path) -> None:
    first = VersionStore(tmp_path / "versions")
    _complete(first, JOB_A, tiny_model_dir)
    second = VersionStore(tmp_path / "versions")  # while the first still runs: a folder of its own
    assert second.root == tmp_path / "versions-2"
    first.close()  # the first process ends ...
    again = VersionStore(tmp_path / "versions")  # ... and is started again: its versions are there
    assert again.root == tmp_path / "versions" and again.open(JOB_A, first.get(JOB_A, 0).manifest).complete


def _truncate(path: Path) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)


def test_a_version_whose_file_was_cut_short_on_disk_is_not_taken_as_held_after_a_restart(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    manifest = build_manifest(tiny_model_dir, 0, 0, CHUNK)
    store = VersionStore(tmp_path / "versions")
    held = store.open(JOB_A, manifest, "k" * 64)
    for i, data in enumerate(iter_stream(tiny_model_dir, manifest.files, CHUNK)):
        held.put(i, data)
    held.assemble()
    _truncate(held.model_dir / "model.safetensors")
    store.close()  # the worker stops

    restarted = VersionStore(tmp_path / "versions")  # the next `echo2-worker join` on the same --data-dir
    again = restarted.open(JOB_A, manifest, "k" * 64)
    assert not again.complete and again.missing(), \
        "a folder whose model.safetensors is half the size the manifest says is taken as a complete version"
    assert restarted.weights(JOB_A, 0) is None


def test_a_worker_restarted_on_a_damaged_cache_fetches_the_version_again(api: Api, tiny_model_dir: Path,
                                                                         tmp_path: Path) -> None:
    setup = start_job(api, tiny_model_dir)
    first = start_worker(api, setup, tmp_path / "machine", name="first")
    wait_for(lambda: rollouts(api, setup.id, "accepted"), 120, "accepted rollouts")
    assert first.drain() == 0  # the provider stops the worker (SIGTERM); its versions stay on disk
    [weights] = (tmp_path / "machine" / "versions").glob("*/v0/model/model.safetensors")
    _truncate(weights)

    second = start_worker(api, setup, tmp_path / "machine", name="second")  # and starts it again
    try:
        wait_for(lambda: any(r["worker_id"] == second.worker_id for r in rollouts(api, setup.id, "accepted"))
                 or not second.thread.is_alive(), 120, "the restarted worker's rollouts, or its end")
        assert second.thread.is_alive(), (
            f"the restarted worker loaded the damaged folder and ended ({worker_row(api, second.worker_id)['status']})"
            " instead of fetching the version again")
    finally:
        if second.thread.is_alive():
            second.drain()


def test_a_version_damaged_in_place_is_fetched_again_once_its_load_fails(api: Api, tiny_model_dir: Path,
                                                                       tmp_path: Path) -> None:
    """Damage that keeps the file's size (its safetensors header overwritten) passes the check at start; the load
    fails, the files are hashed, and the version is deleted and fetched again."""
    setup = start_job(api, tiny_model_dir)
    first = start_worker(api, setup, tmp_path / "machine", name="first")
    wait_for(lambda: rollouts(api, setup.id, "accepted"), 120, "accepted rollouts")
    assert first.drain() == 0
    [weights] = (tmp_path / "machine" / "versions").glob("*/v0/model/model.safetensors")
    with open(weights, "r+b") as fh:
        fh.write(b"\xff" * 8)  # a header length past the file's end

    second = start_worker(api, setup, tmp_path / "machine", name="second")
    try:
        wait_for(lambda: any(r["worker_id"] == second.worker_id for r in rollouts(api, setup.id, "accepted"))
                 or not second.thread.is_alive(), 120, "the restarted worker's rollouts, or its end")
        assert second.thread.is_alive()
    finally:
        if second.thread.is_alive():
            second.drain()
