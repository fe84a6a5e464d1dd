"""A Tinker model on a learner host, in process, on the tiny model: the losses are the ones stated in
learner/tinker/losses.py, gradients accumulate until optim_step, checkpoints sample as saved, stops stop.
On the CPU, and on a CUDA GPU where there is one (a host's `--device`)."""

from __future__ import annotations

import math

import pytest
import torch
from echo2.protocol.tinker import (
    AdamStep,
    AuditPayload,
    ForwardBackwardPayload,
    ModelSpec,
    SamplePayload,
    SavePayload,
    TinkerLora,
)

from learner.tinker.session import TinkerSession, UserError

PROMPT = [5, 6, 7, 8]
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="no CUDA GPU here")])


@pytest.fixture(scope="module", params=["cpu", CUDA])
def device(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def session(tiny_model_dir, tmp_path_factory, device) -> TinkerSession:
    spec = ModelSpec(base_model=str(tiny_model_dir), lora=TinkerLora(rank=4, seed=0))
    return TinkerSession(spec, tmp_path_factory.mktemp("cache"), device)


def one(session: TinkerSession, payload: SamplePayload):
    return session.sample([payload])[0]


def fwdbwd(session: TinkerSession, loss: str, inputs: dict, forward_only: bool = False, **config: float):
    datum = {"tokens": PROMPT, "target_tokens": [6, 7, 8, 9], "inputs": inputs}
    payload = ForwardBackwardPayload(loss_fn=loss, data=[datum], forward_only=forward_only, loss_fn_config=config)
    return session.forward_backward(payload)


def test_losses_are_the_stated_sums(session):
    base = fwdbwd(session, "cross_entropy", {}, forward_only=True)
    p = base.outputs[0]["logprobs"]
    weights = [0.0, 0.5, 1.0, 2.0]
    ce = fwdbwd(session, "cross_entropy", {"weights": weights}, forward_only=True)
    assert ce.metrics["loss:sum"] == pytest.approx(-sum(w * x for w, x in zip(weights, p, strict=True)), rel=1e-5)
    q, adv = [x - 0.5 for x in p], [1.0, -1.0, 2.0, 0.0]  # the sampler was less likely: ratio e^0.5
    inputs = {"logprobs": q, "advantages": adv}
    ratio = math.exp(0.5)
    is_loss = fwdbwd(session, "importance_sampling", inputs, forward_only=True).metrics["loss:sum"]
    assert is_loss == pytest.approx(-ratio * sum(adv), rel=1e-4)
    ppo = fwdbwd(session, "ppo", inputs, forward_only=True, clip_high_threshold=1.2).metrics
    # min(r A, clip(r) A): clipped to 1.2 where A > 0, the unclipped r A where A < 0.
    assert ppo["loss:sum"] == pytest.approx(-(1.2 * 1.0 - ratio * 1.0 + 1.2 * 2.0), rel=1e-4)
    assert ppo["clipped:sum"] == 3


def test_gradients_accumulate_until_the_step(session):
    before = [p.detach().clone() for p in session.params]
    first = fwdbwd(session, "cross_entropy", {}).metrics["loss:sum"]
    fwdbwd(session, "cross_entropy", {})
    accumulated = [p.grad.clone() for p in session.params]
    session.optim_step(AdamStep(learning_rate=0.0))
    fwdbwd(session, "cross_entropy", {})
    single = [p.grad.clone() for p in session.params]
    assert all(torch.allclose(a, 2 * s, atol=1e-6) for a, s in zip(accumulated, single, strict=True))
    assert all(torch.equal(b, p) for b, p in zip(before, session.params, strict=True))  # lr 0: unchanged
    session.optim_step(AdamStep(learning_rate=1e-2))
    assert fwdbwd(session, "cross_entropy", {}, forward_only=True).metrics["loss:sum"] < first


def test_a_checkpoint_samples_as_saved(session):
    session.save(SavePayload(name="then", kind="sampler"))
    params = {"max_tokens": 4, "temperature": 0.0}
    then = one(session, SamplePayload(checkpoint="then", prompt=PROMPT, num_samples=1, params=params))
    for _ in range(3):
        fwdbwd(session, "cross_entropy", {"weights": [1.0] * 4})
        session.optim_step(AdamStep(learning_rate=0.05))
    now = [p.detach().clone() for p in session.params]
    again = one(session, SamplePayload(checkpoint="then", prompt=PROMPT, num_samples=1, params=params))
    assert again.sequences[0].tokens == then.sequences[0].tokens
    assert all(torch.equal(a, b) for a, b in zip(now, session.params, strict=True))  # swapped back after
    with pytest.raises(UserError, match="no checkpoint 'never'"):
        one(session, SamplePayload(checkpoint="never", prompt=PROMPT, num_samples=1, params=params))


def test_sampling_stops_and_reports_logprobs(session):
    drawn = one(session, SamplePayload(prompt=PROMPT, num_samples=8, prompt_logprobs=True,
                                         params={"max_tokens": 6, "temperature": 1.0, "seed": 3}))
    assert len(drawn.sequences) == 8 and drawn.prompt_logprobs[0] is None and len(drawn.prompt_logprobs) == 4
    for seq in drawn.sequences:
        assert len(seq.tokens) == len(seq.logprobs) and (len(seq.tokens) == 6 or seq.stop_reason == "stop")
    stop = drawn.sequences[0].tokens[0]
    stopped = one(session, SamplePayload(prompt=PROMPT, num_samples=1, params={
        "max_tokens": 6, "temperature": 1.0, "seed": 3, "stop_tokens": [stop]}))
    assert stopped.sequences[0].tokens == [stop] and stopped.sequences[0].stop_reason == "stop"
    never = one(session, SamplePayload(prompt=PROMPT, num_samples=2, params={
        "max_tokens": 5, "temperature": 1.0, "stop_tokens": []}))
    assert all(len(s.tokens) == 5 and s.stop_reason == "length" for s in never.sequences)


def test_a_batch_of_requests_samples_as_each_would_alone(session):
    """Left-padding and per-request parameters: greedy continuations and their logprobs match one by one.
    Within 1e-4 relative: padded and unpadded attention are different fp32 kernels, and once earlier tests
    have trained the adapter a logprob of -18 differed by 9e-4 between them."""
    payloads = [SamplePayload(prompt=prompt, num_samples=2, prompt_logprobs=True,
                              params={"max_tokens": n, "temperature": 0.0})
                for prompt, n in (([5, 6, 7, 8, 9, 10], 5), ([11, 12], 3), ([13, 14, 15], 4))]
    together = session.sample(payloads)
    for payload, batched in zip(payloads, together, strict=True):
        alone = one(session, payload)
        for a, b in zip(alone.sequences, batched.sequences, strict=True):
            assert a.tokens == b.tokens and len(b.tokens) == payload.params.max_tokens
            assert b.logprobs == pytest.approx(a.logprobs, rel=1e-4, abs=1e-4)
        assert batched.prompt_logprobs[0] is None
        assert batched.prompt_logprobs[1:] == pytest.approx(alone.prompt_logprobs[1:], rel=1e-4, abs=1e-4)


def test_datums_of_any_length_train_together_as_alone(session, monkeypatch):
    """Right-padded micro-batches (forced small here) give each datum the logprobs it gets alone."""
    data = [{"tokens": tokens, "target_tokens": [t + 1 for t in tokens], "inputs": {}}
            for tokens in ([5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17])]
    together = session.forward_backward(ForwardBackwardPayload(loss_fn="cross_entropy", data=data,
                                                               forward_only=True))
    monkeypatch.setattr("learner.tinker.session.MICRO_BATCH_TOKENS", 8)
    split = session.forward_backward(ForwardBackwardPayload(loss_fn="cross_entropy", data=data, forward_only=True))
    for datum, a, b in zip(data, together.outputs, split.outputs, strict=True):
        alone = session.forward_backward(ForwardBackwardPayload(loss_fn="cross_entropy", data=[datum],
                                                                forward_only=True)).outputs[0]
        assert len(a["logprobs"]) == len(datum["tokens"])
        for other in (b, alone):
            assert max(abs(x - y) for x, y in zip(a["logprobs"], other["logprobs"], strict=True)) < 1e-4
    assert together.metrics["loss:sum"] == pytest.approx(split.metrics["loss:sum"], rel=1e-5)


def test_a_parked_model_comes_back_as_it_was(tiny_model_dir, tmp_path, device):
    spec = ModelSpec(base_model=str(tiny_model_dir), lora=TinkerLora(rank=4, seed=0))
    model = TinkerSession(spec, tmp_path / "cache", device)
    fwdbwd(model, "cross_entropy", {})
    model.optim_step(AdamStep(learning_rate=1e-2))
    model.save(SavePayload(name="first", kind="sampler"))
    fwdbwd(model, "cross_entropy", {})  # gradients pending at park time
    model.park(tmp_path / "parked" / "m.pt")
    back = TinkerSession.restore(spec, tmp_path / "cache", device, tmp_path / "parked" / "m.pt")
    assert back.steps == 1 and list(back.checkpoints) == ["first"]
    for mine, theirs in zip(model.params, back.params, strict=True):
        assert torch.equal(mine, theirs) and torch.equal(mine.grad, theirs.grad)
    # The same next step from the same Adam moments: identical weights after it.
    assert model.optim_step(AdamStep(learning_rate=1e-2)) == back.optim_step(AdamStep(learning_rate=1e-2))
    for mine, theirs in zip(model.params, back.params, strict=True):
        assert torch.equal(mine, theirs)
    saved = SamplePayload(checkpoint="first", prompt=PROMPT, num_samples=2, params={"max_tokens": 6, "seed": 3})
    assert one(model, saved) == one(back, saved)
    with pytest.raises(FileNotFoundError, match="parked state of this model is gone"):
        TinkerSession.restore(spec, tmp_path / "cache", device, tmp_path / "parked" / "missing.pt")


def test_a_saved_state_loads_with_or_without_its_optimizer(tiny_model_dir, tmp_path):
    spec = ModelSpec(base_model=str(tiny_model_dir), lora=TinkerLora(rank=4, seed=0))
    model = TinkerSession(spec, tmp_path / "cache")
    fwdbwd(model, "cross_entropy", {})
    model.optim_step(AdamStep(learning_rate=1e-2))
    model.save_state(tmp_path / "state.pt")
    for optimizer, steps in ((True, 1), (False, 0)):
        fresh = TinkerSession(ModelSpec(base_model=str(tiny_model_dir), lora=TinkerLora(rank=4, seed=1)),
                              tmp_path / "cache")
        fresh.load_state(tmp_path / "state.pt", optimizer)
        assert fresh.steps == steps and (fresh.optimizer is not None) == optimizer
        assert all(torch.equal(a, b) for a, b in zip(model.params, fresh.params, strict=True))
    wider = TinkerSession(ModelSpec(base_model=str(tiny_model_dir), lora=TinkerLora(rank=8)), tmp_path / "cache")
    with pytest.raises(UserError, match="does not fit this model"):
        wider.load_state(tmp_path / "state.pt", optimizer=True)
    with pytest.raises(UserError, match="not on this learner host"):
        wider.load_state(tmp_path / "nowhere.pt", optimizer=True)


def test_the_host_refuses_what_the_door_could_not_check_yet(session):
    """Requests queued before the host had loaded the model passed the door without its vocabulary and context."""
    vocab, context = session.model.config.vocab_size, session.model.config.max_position_embeddings
    too_long = {"tokens": [5] * (context + 1), "target_tokens": [6] * (context + 1), "inputs": {}}
    outside = {"tokens": [vocab], "target_tokens": [6], "inputs": {}}
    for datum, reason in ((too_long, "beyond the model's context"), (outside, "below the vocabulary size")):
        with pytest.raises(UserError, match=reason):
            session.forward_backward(ForwardBackwardPayload(loss_fn="cross_entropy", data=[datum]))
    with pytest.raises(UserError, match="must fit the model's context"):
        one(session, SamplePayload(prompt=[5] * context, num_samples=1, params={"max_tokens": 1}))


def test_a_tinker_model_cannot_be_another_users_files_on_the_host(tiny_model_dir, tmp_path):
    """The host's work dir holds other users' parked and saved states (and a learner's, their checkpoints)."""
    import shutil

    theirs = tmp_path / "host" / "states" / "model"
    shutil.copytree(tiny_model_dir, theirs)
    with pytest.raises(UserError, match="inside Echo2's own data"):
        TinkerSession(ModelSpec(base_model=str(theirs), lora=TinkerLora(rank=4)), tmp_path / "host" / "models",
                      private=(tmp_path / "host",))


def test_a_fleet_group_claiming_bf16_is_re_scored_by_a_shadow_of_its_checkpoint(session):
    """The host's audit gives a group whose worker claims bfloat16 a shadow (learner/audit.py): the claimed
    checkpoint's weights in bf16, whose difference from the audit caps the replay's margin. It holds that
    checkpoint, not the weights trained since, and a float32 claim gets none."""
    session.save(SavePayload(name="audited", kind="sampler"))
    session.published["audited"] = 7
    drawn = one(session, SamplePayload(checkpoint="audited", prompt=PROMPT, num_samples=4,
                                       params={"max_tokens": 6, "temperature": 1.0, "seed": 5}))
    for _ in range(3):  # the current weights move away from the checkpoint
        fwdbwd(session, "cross_entropy", {"weights": [1.0] * 4})
        session.optim_step(AdamStep(learning_rate=0.05))
    samples = [(s.tokens, s.logprobs) for s in drawn.sequences]

    def audit(precision: str):
        return session.audit(AuditPayload(checkpoint="audited", version=7, rollout_id="rol_1", prompt=PROMPT,
                                          samples=samples, temperature=1.0, top_p=1.0, top_k=0,
                                          precision=precision))

    bf16, fp32 = audit("bfloat16"), audit("float32")
    assert bf16.passed and fp32.passed, (bf16.reason, fp32.reason)
    assert 0 < bf16.stats["rounding"] < 0.05 and "rounding" not in fp32.stats
    assert bf16.stats["max_abs_diff"] < 1e-4  # the audit itself read the checkpoint, as the host drew with it
