"""The unmodified `tinker` SDK (from .venv-tinker, as a subprocess) against a real control plane over HTTP
and a Tinker learner host process: a LoRA training client on echo2:tiny, forward_backward with the three
losses, optim_step, save_weights_for_sampler, sampling, save_state and resuming from it in a new session,
and the errors of what Echo2 does not do."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from api.tinker.models import TinkerRequest
from tests.tinker.conftest import HOST_PRICE

FLOW = Path(__file__).with_name("sdk_flow.py")


def run_flow(tinker_python: Path, url: str, key: str, home: Path) -> dict:
    env = {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": f"tml-{key}", "HOME": str(home)}
    done = subprocess.run([str(tinker_python), str(FLOW), "echo2:tiny"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.postgres_only  # its SQLite twin runs with -m slow: CI's time budget
def test_the_tinker_sdk_trains_saves_and_samples(api, tinker_python, tinker_host, user_key, tmp_path):
    seen = run_flow(tinker_python, api.url, user_key, tmp_path)

    losses = seen["ce_losses"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.5 * losses[0], losses
    assert seen["greedy"] == seen["answer"]  # twelve steps on one example: it says 46 after 12+34=
    assert Path(seen["tokenizer_id"]).is_dir()  # get_tokenizer loads it without the hub
    assert seen["path"] == f"tinker://{seen['model_id']}/sampler_weights/trained"
    samples = seen["samples"]
    assert len(samples) == 4 and all(len(s["tokens"]) == 6 or s["stop"] == "stop" for s in samples)
    assert all(len(s["tokens"]) == len(s["logprobs"]) and all(lp <= 0 for lp in s["logprobs"]) for s in samples)
    _trainer_agrees_with_sampler(seen)
    assert seen["prompt_logprobs"][0] is None and all(lp <= 0 for lp in seen["prompt_logprobs"][1:])
    _errors_are_immediate_and_clear(seen["errors"])
    session = seen["session"]  # RestClient.list_sessions / get_session
    assert session["listed"][0] == session["id"] and session["training_run_ids"] == [seen["model_id"]]
    assert len(session["sampler_ids"]) == 2  # create_sampling_client and save_weights_and_get_sampling_client
    _a_saved_state_resumes_in_a_new_session(seen)
    _futures_outlive_the_client(api, user_key, seen["model_id"])
    _usage_is_billed(api, user_key, seen["model_id"])


def _trainer_agrees_with_sampler(seen: dict) -> None:
    """Right after the save the trained weights are the sampled ones: ratio 1 on every completion token, so
    importance_sampling and ppo both give -(number of completion tokens)."""
    completions = [s for s in seen["samples"] if s["tokens"]]
    tokens = sum(len(s["tokens"]) for s in completions)
    for loss in ("importance_sampling", "ppo"):
        assert abs(seen[loss]["metrics"]["loss:sum"] + tokens) < 1e-2 * tokens, seen[loss]["metrics"]
        for sample, logprobs in zip(completions, seen[loss]["logprobs"], strict=True):
            tail = logprobs[-len(sample["tokens"]):]
            assert max(abs(a - b) for a, b in zip(tail, sample["logprobs"], strict=True)) < 1e-3


def _a_saved_state_resumes_in_a_new_session(seen: dict) -> None:
    """save_state, then create_training_client_from_state[_with_optimizer] in another session: the same weights
    (the same logprobs), and Adam's step count goes on (13 steps were taken) or starts again."""
    assert seen["state_path"] == f"tinker://{seen['model_id']}/weights/resume-point"
    resumed = seen["resumed"]
    assert max(abs(a - b) for a, b in zip(resumed["logprobs"], seen["state_logprobs"], strict=True)) < 1e-5
    assert resumed["steps"] == [14.0, 1.0]


def _errors_are_immediate_and_clear(errors: dict) -> None:
    expected = {"unknown_model": ("BadRequestError", "unknown base model 'Qwen/Qwen3-8B'"),
                "unsupported_method": ("NotFoundError", "does not implement the Tinker call"),
                "unknown_loss": ("BadRequestError", "loss_fn 'custom' is not supported")}
    for name, (kind, text) in expected.items():
        assert errors[name]["raised"] == kind and text in errors[name]["message"], errors[name]
        assert errors[name]["seconds"] < 15, errors[name]


def _futures_outlive_the_client(api, user_key: str, model_id: str) -> None:
    """A finished future answers again after its client is gone (durable), and only to its owner."""
    with api.db.session() as db:
        request_id = db.scalar(select(TinkerRequest.id).where(TinkerRequest.model_id == model_id,
                                                              TinkerRequest.kind == "forward_backward").limit(1))
    body = {"request_id": request_id, "allow_metadata_only": True}
    again = httpx.post(f"{api.url}/api/v1/retrieve_future", json=body, headers={"X-API-Key": f"tml-{user_key}"})
    assert again.status_code == 200 and again.headers["content-type"] == "application/x-protobuf"
    stranger = httpx.post(f"{api.url}/api/v1/retrieve_future", json=body,
                          headers={"Authorization": f"Bearer {api.admin.headers['Authorization'].split()[1]}"})
    assert stranger.status_code == 404


def _usage_is_billed(api, user_key: str, model_id: str) -> None:
    """Every request the host ran is in the user's Tinker ledger: its tokens, the host's measured compute time,
    at the host's price."""
    bill = httpx.get(f"{api.url}/v1/tinker/usage", headers={"Authorization": f"Bearer {user_key}"}).json()
    mine = [e for e in bill["entries"] if e["model_id"] == model_id]
    kinds = {e["kind"] for e in mine}
    assert {"create_model", "forward_backward", "optim_step", "save_weights_for_sampler"} <= kinds, kinds
    assert any(e["kind"] == "sample" for e in bill["entries"])  # on the sampler's model
    for entry in bill["entries"]:
        assert entry["host"] == "test-host" and entry["price_per_hour"] == HOST_PRICE
        assert entry["amount_usd"] == pytest.approx(HOST_PRICE * entry["seconds"] / 3600)
    assert all(e["tokens"] > 0 and e["seconds"] > 0 for e in mine if e["kind"] == "forward_backward")
    assert bill["total_usd"] == pytest.approx(sum(e["amount_usd"] for e in bill["entries"])) and bill["total_usd"] > 0
