"""Learner hosts with several GPUs: a slot is a GPU, each learner sees only its slots' GPUs
(CUDA_VISIBLE_DEVICES), and an N-GPU job starts only where N GPUs that hold it are free on one host.

The hosts are registered as `echo2-server learner-host` registers itself (hosts.describe over the GPUs
its probe found), with made-up GPUs: no GPU is needed to place learners."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from api.models import Job
from learner.launch import run_job
from learner.loop import LearnerOptions
from scheduler import hosts
from scheduler.reconcile import tick
from tests.factories import new_job, new_user, ok


def gpu_host(api, name: str, sizes: list[float], ids: list[str] | None = None) -> None:
    found = [{"id": ids[i] if ids else str(i), "name": "NVIDIA H100 80GB HBM3", "memory_gib": size}
             for i, size in enumerate(sizes)]
    slots, gpus = hosts.describe(None, found)
    with api.db.session() as s:
        hosts.register(s, name, slots, gpus=gpus)
        s.commit()


def launches(api) -> dict[str, tuple[str, object]]:
    """One real reconcile tick; job id -> (learner token, placement) of each learner it launched."""
    launched = {}
    with api.db.session() as s:
        tick(s, api.server.settings, lambda job, token, placement: launched.__setitem__(job, (token, placement)))
    return launched


def reason(user, job_id: str) -> str:
    return ok(user.get(f"/v1/jobs/{job_id}"))["status_reason"]


def children_running(module: str) -> dict[str, str]:
    """pid -> CUDA_VISIBLE_DEVICES of this process's children that run `python -m <module>`."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue  # it just ended
            if module.encode() in argv:
                mask = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"CUDA_VISIBLE_DEVICES=")]
                out[pid] = mask[0] if mask else None
    return out


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_two_learners_on_a_two_gpu_host_each_see_only_their_own_gpu(api, tmp_path):
    """The whole launch path: the tick places both on host GPUs "3" and "5" (the ids that host's own
    CUDA_VISIBLE_DEVICES gave them), and run_job, as the learner host's Celery task calls it, starts
    each learner as its own process whose CUDA_VISIBLE_DEVICES is its GPU alone."""
    _, alice = new_user(api)
    gpu_host(api, "two-gpus", [79.1, 79.1], ids=["3", "5"])
    jobs = [new_job(alice, name=f"job{i}", learner={"gpus": 1})["id"] for i in range(2)]
    launched = launches(api)
    assert sorted(p.devices[0] for _, p in launched.values()) == ["3", "5"]
    with api.db.session() as s:
        assert {s.get(Job, j).learner_placement["host"] for j in jobs} == {"two-gpus"}

    failures: list[BaseException] = []
    threads = [threading.Thread(target=_run, args=(failures, api.url, launched[j][0], j, tmp_path / j,
                                                   launched[j][1].devices)) for j in jobs]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 300  # loading torch in two children on a busy machine
        while len(seen := children_running("learner.launch")) < 2:
            assert time.monotonic() < deadline and not failures, (seen, failures)
            time.sleep(0.1)
        assert sorted(seen.values()) == ["3", "5"], seen
    finally:
        for job in jobs:
            ok(alice.post(f"/v1/jobs/{job}/cancel"))
        for thread in threads:
            thread.join(timeout=300)
    assert failures == [] and not any(t.is_alive() for t in threads)


def _run(failures: list[BaseException], url: str, token: str, job_id: str, work: Path, devices: list[str]) -> None:
    try:
        run_job(url, token, job_id, LearnerOptions(work_dir=work, threads=1), devices)
    except BaseException as exc:  # the test asserts on it
        failures.append(exc)


def test_an_n_gpu_job_waits_until_n_gpus_are_free_on_one_host(api):
    _, alice = new_user(api)
    gpu_host(api, "a", [79.1] * 3)
    gpu_host(api, "b", [79.1] * 3)
    x = new_job(alice, name="x", learner={"gpus": 2})["id"]
    y = new_job(alice, name="y", learner={"gpus": 2})["id"]
    launched = launches(api)
    assert {j: (p.host, p.devices) for j, (_, p) in launched.items()} == {x: ("a", ["0", "1"]), y: ("b", ["0", "1"])}

    pair = new_job(alice, name="pair", learner={"gpus": 2})["id"]
    assert launches(api) == {}  # 2 GPUs are free, but not on one host
    assert reason(alice, pair) == ("waiting for a learner, 1st in line: its 2-GPU learner needs 2 free slot(s) of "
                                   f"at least {_need(api, pair):.1f} GiB on one host (the most free on one host: 1; "
                                   "2 of 6 free in all)")
    ok(alice.post(f"/v1/jobs/{x}/cancel"))
    launched = launches(api)
    assert list(launched) == [pair] and launched[pair][1].host == "a"
    assert launched[pair][1].devices == ["0", "1"]  # x's GPUs, free again; y's stay its own


def test_a_learner_goes_only_to_gpus_that_hold_its_memory_need(api, tmp_path):
    _, alice = new_user(api)
    gpu_host(api, "small", [10.0, 10.0])
    gpu_host(api, "large", [79.1])
    big = new_job(alice, name="big", base_model=str(_qwen_shape(tmp_path)),
                  learner={"gpus": 1, "activation_checkpointing": True},
                  lora={"rank": 16})["id"]
    need = _need(api, big)
    assert 10 < need < 79.1
    small = new_job(alice, name="small", learner={"gpus": 1})["id"]
    launched = launches(api)
    assert launched[big][1].host == "large" and launched[small][1].host == "small"
    again = new_job(alice, name="again", base_model=str(_qwen_shape(tmp_path)),
                  learner={"gpus": 1, "activation_checkpointing": True},
                  lora={"rank": 16})["id"]
    assert launches(api) == {}
    assert reason(alice, again).endswith(f"its learner needs 1 free slot(s) of at least {need:.1f} GiB on one host "
                                         "(the most free on one host: 0; 1 of 3 free in all)")


def test_a_host_never_offers_more_slots_than_gpus():
    gpus = [{"id": "0", "name": "H100", "memory_gib": 79.1}, {"id": "1", "name": "H100", "memory_gib": 79.1}]
    assert hosts.describe(None, gpus) == (2, gpus)
    assert hosts.describe(1, gpus) == (1, gpus[:1])
    assert hosts.describe(4, gpus) == (2, gpus)  # never two learners on one card
    with pytest.raises(ValueError, match="at least 1 slot"):
        hosts.describe(0, gpus)
    assert hosts.describe(3, []) == (3, [])
    assert hosts.describe(None, [])[0] == max(1, (os.cpu_count() or 2) // 2)


def _need(api, job_id: str) -> float:
    with api.db.session() as s:
        return s.get(Job, job_id).learner_memory_gib


def _qwen_shape(tmp_path: Path) -> Path:
    """A model folder with Qwen2.5-7B's config (no weights: the control plane reads only the config)."""
    folder = tmp_path / "qwen7b"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(QWEN_7B)
    return folder


QWEN_7B = ('{"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, '
           '"num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": false}')
