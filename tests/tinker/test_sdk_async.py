"""The unmodified `tinker` SDK (from .venv-tinker, as a subprocess: tests/tinker/async_flow.py) against a real control
plane over HTTP and a real Tinker learner host on echo2:tiny, for every call issue 31 made supported: the cispo,
dro, gspo and stable_reinforce losses (stable_reinforce on sequences recorded with record_stability_info, named by
provenance spans), top-k prompt and sample logprobs, prompt_logprobs_last_n, prompt_alt_tokens_k, an in-flight
sampling client whose sample spans two checkpoints, save_state with a TTL, list_checkpoints, list_user_checkpoints,
set_checkpoint_ttl, copy_weights, delete_checkpoint, and the billing calls. A second host process then loads the
state the first one saved."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from api.tinker.models import TinkerCheckpoint, TinkerModel
from tests.conftest import ADMIN_KEY

FLOW = Path(__file__).with_name("async_flow.py")
ROOT = Path(__file__).resolve().parents[2]


def run_flow(tinker_python: Path, url: str, key: str, home: Path) -> dict:
    env = {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": f"tml-{key}", "HOME": str(home)}
    done = subprocess.run([str(tinker_python), str(FLOW), "echo2:tiny"], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.postgres_only  # its SQLite twin runs with -m slow, like test_sdk.py
def test_the_sdk_runs_the_async_rl_calls(api, tinker_python, tinker_host, user_key, tmp_path, host_work_dir):
    before = _stored(api)
    seen = run_flow(tinker_python, api.url, user_key, tmp_path)
    _losses(seen["losses"], len(seen["prompt"]))
    _logprob_calls(seen["logprobs"], len(seen["prompt"]))
    _inflight(seen["inflight"])
    _life_cycle(api, seen["life_cycle"], before)
    _billing(seen["billing"])
    _another_host_loads_the_state(api, tinker_python, tinker_host, user_key, tmp_path, host_work_dir,
                                  seen["life_cycle"]["state"])


def _losses(seen: dict, prompt_len: int) -> None:
    """Right after the save, the trained weights are the sampler's: ratio 1 on every sampled token. So (A the
    sequence's advantage, n its tokens): cispo = dro = -sum A * p (clip(1) = 1, no penalty), gspo (s = 1, one
    sequence per datum) = -sum A, stable_reinforce = -sum A * p again (weight min(1, 2) = 1)."""
    for sample, logprobs in zip(seen["sampled"], seen["cispo"]["logprobs"], strict=True):
        assert max(abs(a - b) for a, b in zip(sample["logprobs"], logprobs, strict=True)) < 1e-3
    score = -sum(a * sum(s["logprobs"]) for a, s in zip(seen["advantages"], seen["sampled"], strict=True))
    for loss in ("cispo", "dro", "stable_reinforce"):
        assert seen[loss]["loss"] == pytest.approx(score, abs=1e-2), (loss, seen[loss])
    assert seen["gspo"]["loss"] == pytest.approx(-sum(seen["advantages"]), abs=1e-2)
    assert seen["stable_reinforce"]["metrics"]["truncated:sum"] == 0
    assert seen["record"]["tokens"] == seen["sampled"][0]["tokens"] and seen["record"]["recorded_until"]
    assert seen["forged"]["raised"] == "BadRequestError" and "are not the sampled tokens" in seen["forged"]["message"]
    assert seen["no_spans"]["raised"] == "BadRequestError" and "needs provenance spans" in seen["no_spans"]["message"]
    assert math.isfinite(seen["stable_reinforce"]["loss"])


def _logprob_calls(seen: dict, prompt_len: int) -> None:
    lps, topk = seen["prompt_logprobs"], seen["topk_prompt"]
    assert lps[0] is None and topk[0] is None and len(lps) == len(topk) == prompt_len
    for lp, top in zip(lps[1:], topk[1:], strict=True):
        assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1] and lp <= top[0][1] + 1e-5
    for tokens, logprobs, top in zip(seen["sample_tokens"], seen["sample_logprobs"], seen["topk_sample"], strict=True):
        for token, lp, row in zip(tokens, logprobs, top, strict=True):
            assert len(row) == 2 and lp <= row[0][1] + 1e-5 and (token != row[0][0] or abs(lp - row[0][1]) < 1e-4)
    last = seen["last_prompt_logprobs"]
    assert all(v is None for v in last[:-2]) and all(v is not None for v in last[-2:])
    assert last[-2:] == pytest.approx(lps[-2:], abs=1e-5) and seen["last_topk"][-3] is None
    assert seen["alt_shape"] == [prompt_len - 1, 3]
    assert all(lp <= 0 for row in seen["alt_logprobs"] for lp in row)
    assert seen["too_many"]["raised"] == "BadRequestError" and "at most 64" in seen["too_many"]["message"]


def _inflight(seen: dict) -> None:
    """The 96-token sample is drawn in segments of 16 tokens; the training step and the second in-flight save sent
    after it run between two of its segments (which two depends on the machine's speed), and the segments after
    that are drawn with the newer checkpoint: its tokens span the two checkpoints, switching at a segment's end."""
    runs = [(c["checkpoint"], c["tokens"]) for c in seen["record"]["checkpoints"]]
    assert len(runs) == 2 and runs[0][1] % 16 == 0 and sum(n for _, n in runs) == seen["tokens"] == 96, runs
    assert runs[0][0] != runs[1][0]
    assert [c["checkpoint"] for c in seen["after"]["checkpoints"]] == [runs[1][0]]


def _stored(api) -> set[str]:
    return {p.stem for p in (api.server.settings.data_dir / "tinker-states").glob("*.pt")}


def _life_cycle(api, seen: dict, before: set[str]) -> None:
    kept = seen["listed"][seen["state"]]
    assert (kept["type"], kept["expires"]) == ("training", True) and kept["size"] > 0
    assert seen["listed"][seen["other"]]["expires"] is False
    assert seen["expiry"][seen["other"]] is True
    assert seen["copy"].endswith("/weights/keep") and seen["copy"] != seen["state"]
    assert seen["other"] not in seen["after_delete"] and seen["state"] in seen["after_delete"]
    assert seen["copy"] in seen["user_paths"] and seen["other"] not in seen["user_paths"]
    assert seen["bad_ttl"]["raised"] == "BadRequestError" and "between 3600" in seen["bad_ttl"]["message"]
    assert seen["load_deleted"]["raised"] == "NotFoundError"
    assert (seen["run"]["is_lora"], seen["run"]["lora_rank"]) == (True, 4) and seen["run"]["id"] in seen["runs"]
    assert seen["run"]["last_checkpoint"] == seen["state"]  # the newest state left after the delete
    assert seen["weights_info"] == {"lora_rank": 4, "base_model": "echo2:tiny"}
    assert seen["copy_sampler"]["raised"] == "BadRequestError"
    with api.db.session() as db:
        kept_digests = set(db.scalars(select(TinkerCheckpoint.sha256).where(TinkerCheckpoint.name == "keep")))
    # The deleted state's file is gone; the kept one (shared by its copy) stays.
    assert len(kept_digests) == 1 and _stored(api) - before == kept_digests


def _billing(seen: dict) -> None:
    kinds = {e["type"] for e in seen["events"]}
    assert {"training", "sampling_prefill", "sampling_sample", "checkpoint"} <= kinds, kinds
    assert all(e["usd"] >= 0 for e in seen["events"])
    assert seen["storage_bytes"] > 0 and seen["storage_count"] >= 2


def _another_host_loads_the_state(api, tinker_python, first_host, user_key, tmp_path, host_work_dir,
                                  state: str) -> None:
    """The first host stops; a second one, with its own work dir (nothing of the first's on its disk), loads the
    state the first one saved, and the SDK trains on from it."""
    first_host.terminate()
    first_host.wait(timeout=60)
    log = (tmp_path / "host2.log").open("w")
    cmd = [sys.executable, "-m", "learner.tinker.host", "--server", api.url, "--name", "second-host", "--slots", "1",
           "--threads", "1", "--device", "cpu", "--work-dir", str(tmp_path / "second")]
    # The built-in models are built once per run: the second host reads them from the first's cache folder.
    (tmp_path / "second").mkdir()
    (tmp_path / "second" / "models").symlink_to(host_work_dir / "models")
    second = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "ECHO2_API_KEY": ADMIN_KEY}, stdout=log,
                              stderr=subprocess.STDOUT)
    try:
        script = ("import sys, tinker; from tinker import types; s = tinker.ServiceClient(); "
                  "t = s.create_training_client_from_state_with_optimizer(sys.argv[1]).result(); "
                  "print(t.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics['step'])")
        env = {**os.environ, "TINKER_BASE_URL": api.url, "TINKER_API_KEY": f"tml-{user_key}", "HOME": str(tmp_path)}
        done = subprocess.run([str(tinker_python), "-c", script, state], env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        assert float(done.stdout.strip().splitlines()[-1]) > 1  # the optimizer's steps went on from the state
        with api.db.session() as db:
            hosts = set(db.scalars(select(TinkerModel.host).where(TinkerModel.kind == "train")))
        assert "second-host" in hosts
    finally:
        second.terminate()
        second.wait(timeout=60)
        log.close()
