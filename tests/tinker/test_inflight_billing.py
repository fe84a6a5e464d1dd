"""An in-flight Tinker sample drawn in three or more segments is billed for every segment.
`api/tinker/service.py::_resume_later` carried the compute time so far as `result.progress.seconds + result.seconds`,
trusting the host to echo back the seconds the control plane handed it; the learner host builds a fresh
`SampleProgress` each segment (`learner/sampling.py::_answer`, `seconds` left at 0), so every segment but the last
two was dropped from the bill. The control plane keeps the seconds so far itself now."""

from __future__ import annotations

from echo2.protocol.tinker import SamplePayload

from learner.sampling import _answer, _Row, _Slice
from tests.factories import new_user, ok
from tests.tinker.test_async_routes import asample, sampler_of
from tests.tinker.test_routes import claim, key_of, ready_model, report, retrieve, sdk


def _host_progress(work: dict, tokens: list[int]) -> dict:
    """What the learner host reports for this request after drawing `tokens` so far, not done yet."""
    payload = SamplePayload.model_validate(work["payload"])
    row = _Row(seed=7, tokens=tokens, logprobs=[-0.5] * len(tokens), runs=[["sampler-0", len(tokens)]])
    s = _Slice(payload=payload, rows=[row], live=[0], budget=1, stop_ids=set(), seed=7)
    return _answer(s).model_dump(mode="json")


def test_every_segment_of_an_inflight_sample_is_billed(api):
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    _, model_id = ready_model(api, client)
    sampler = sampler_of(api, client, model_id, kind="inflight")
    future = asample(client, sampler, [1, 2])
    for drawn in ([5], [5, 6]):  # two segments of one token each, 0.5 s of the host's time each
        work = claim(api, holding=[model_id], price=3600.0)["work"]
        assert work["request_id"] == future["request_id"]
        report(api, work, progress=_host_progress(work, drawn), seconds=0.5)
        assert retrieve(client, future["request_id"]).json()["type"] == "try_again"
    work = claim(api, holding=[model_id], price=3600.0)["work"]
    done = {"tokens": [5, 6, 9], "logprobs": [-0.5, -0.5, -1.0], "stop_reason": "length",
            "checkpoints": [["sampler-0", 3]]}
    report(api, work, sample={"sequences": [done]}, seconds=0.5)  # the third and last segment
    [entry] = [e for e in ok(alice.get("/v1/tinker/usage"))["entries"] if e["request_id"] == future["request_id"]]
    assert entry["seconds"] == 1.5, f"3 segments of 0.5 s billed as {entry['seconds']} s (${entry['amount_usd']:.2f})"
