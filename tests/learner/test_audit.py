"""learner/audit.py on the real tiny model: honest groups from the worker's transformers backend pass, at
temperature 1 and with top-p/top-k; forged ones fail with their reason, the rational cheats (another version,
a nearby model, other seeds, copied, picked or cut-short samples, logprobs always recomputed honestly) by the
replay; hostile but door-valid input never raises. The catch rates on a real model and both backends are
measured by bench/audit.py (docs/RELIABILITY.md)."""

from __future__ import annotations

import copy
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from echo2.loading import load_causal_lm
from echo2.protocol import ClaimedGroup, JobSpec, SampleSubmit
from echo2.seeds import sample_seed
from echo2_worker.backends import GenRequest, create_backend

import learner.auditor
from learner.audit import NUCLEUS_SLACK, AuditConfig, GroupClaim, audit_group, shadow_dtype
from learner.auditor import Auditor
from learner.objective import ObjectiveConfig
from learner.policy import Rollouts, completion_logprobs, grpo_update, pad_batch

V = 96
BASE_SEEDS = [1000 + i for i in range(6)]


def _requests(tok) -> list[GenRequest]:
    return [GenRequest(prompt_token_ids=tok(f"{i}+{i}=")["input_ids"], n=8,
                       seeds=[sample_seed(BASE_SEEDS[i], k) for k in range(8)],
                       max_new_tokens=12, temperature=t, top_p=p, top_k=k)
            for i in range(6) for t, p, k in ((1.0, 1.0, 0), (0.7, 0.9, 0), (1.0, 0.95, 5))]


def _generate(folder, requests, **backend_options):
    backend = create_backend("transformers", device="cpu", **backend_options)
    backend.load(folder)
    try:
        return backend.generate(requests)
    finally:
        backend.close()


@pytest.fixture(scope="module")
def tok(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def model(tiny_dir):

    return load_causal_lm(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def honest(tiny_dir, tok):
    requests = _requests(tok)
    groups = _generate(tiny_dir, requests)
    return [(r, [(s.token_ids, s.logprobs) for s in g]) for r, g in zip(requests, groups, strict=True)]


def claim(request, samples, seed: int | None = None, precision: str = "float32") -> GroupClaim:
    return GroupClaim(prompt=request.prompt_token_ids, samples=samples, temperature=request.temperature,
                      top_p=request.top_p, top_k=request.top_k, seed=seed, precision=precision)


def seed_of(request) -> int:
    return next(b for b in BASE_SEEDS if sample_seed(b, 0) == request.seeds[0])


def run(model, request, samples, config=None, seed: int | None = -1):
    return audit_group(model, claim(request, samples, seed_of(request) if seed == -1 else seed), config)


def rescored(model, request, tokens: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Tokens with their logprobs recomputed honestly under `model`: what a cheater sends."""
    batch = pad_batch([request.prompt_token_ids] * len(tokens), tokens, 0)
    with torch.no_grad():
        lp = completion_logprobs(model, batch, temperature=request.temperature)
    return [(t, lp[i, : len(t)].tolist()) for i, t in enumerate(tokens)]


def test_honest_groups_pass_and_every_token_replays(model, honest):
    for request, samples in honest:
        result = run(model, request, samples)
        assert result.passed, result
        assert result.max_abs_diff < 1e-4 and result.tokens == sum(len(t) for t, _ in samples)
        assert result.replayed == result.tokens and result.mismatches == 0


def test_a_group_stored_without_a_seed_is_judged_without_replay(model, honest):
    request, samples = honest[0]
    result = run(model, request, samples, seed=None)
    assert result.passed and result.replayed == 0


@pytest.mark.parametrize(("forge", "every_sample"), [
    (lambda t, lp, rng: ([rng.randrange(V) for _ in t], [0.0] * len(t)), True),  # random tokens, logprob 0
    (lambda t, lp, rng: (t, [rng.uniform(-3.0, 0.0) for _ in lp]), True),  # invented logprobs
    (lambda t, lp, rng: ([(t[0] + 1) % V, *t[1:]], lp), False),  # one flipped token, its logprob left alone
])
def test_forged_logprobs_fail_with_their_reason(model, honest, forge, every_sample):
    rng = random.Random(0)
    # The tiny model is near uniform (every token about -ln 96): an fp32 tolerance shows the mechanism here;
    # the default, sized for bf16 workers, is measured on a real model by bench/audit.py.
    fp32 = AuditConfig(token_tol=1e-3)
    for request, samples in honest:
        forged = [forge(t, lp, rng) if every_sample or k == 0 else (t, lp) for k, (t, lp) in enumerate(samples)]
        result = run(model, request, forged, fp32)
        assert not result.passed and result.reason.startswith("logprob mismatch"), result


def _nudged(tiny_dir, scale: float, seed: int):

    other = load_causal_lm(tiny_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=gen))
    return other


@pytest.mark.parametrize("cheat", ["other_seeds", "copied", "picked", "cut_short", "hotter"])
def test_rational_cheats_with_honest_logprobs_fail_the_replay(tiny_dir, tok, model, honest, cheat):
    """Each cheat recomputes its logprobs honestly under the claimed model, so only the replay can see it; none
    of these groups is what the leased seeds draw, and every one is caught."""
    requests = _requests(tok)
    if cheat in ("other_seeds", "picked"):  # picked: the best of extra draws, which used seeds never leased
        drawn = _generate(tiny_dir, [replace(r, seeds=[s + 7 for s in r.seeds]) for r in requests])
        forged = [[s.token_ids for s in g] for g in drawn]
    elif cheat == "copied":
        forged = [[samples[0][0]] * len(samples) for _, samples in honest]
    elif cheat == "cut_short":  # stop every sample after one token with an end-of-sequence token
        forged = [[[t[0], tok.eos_token_id] for t, _ in samples] for _, samples in honest]
    else:  # hotter: sampled at twice the job's temperature
        drawn = _generate(tiny_dir, [replace(r, temperature=r.temperature * 2) for r in requests])
        forged = [[s.token_ids for s in g] for g in drawn]
    judged = 0
    for (request, samples), tokens in zip(honest, forged, strict=True):
        if tokens == [t for t, _ in samples]:  # the tiny model is near uniform: twice as hot can draw the same
            continue  # tokens from the leased seeds, and then it is the honest group
        result = run(model, request, rescored(model, request, tokens))
        assert not result.passed and result.mismatches > 0, (cheat, result)
        judged += 1
    assert judged >= len(honest) // 2, (cheat, judged)


def _long(requests: list[GenRequest]) -> list[GenRequest]:
    return [replace(r, max_new_tokens=48) for r in requests]


def test_a_nearby_model_fails_the_replay(tiny_dir, tok, model, tmp_path):
    """The weights plus 5 % noise, logprobs rescored under the claimed model: about one token in twenty is not
    what the claimed model draws (the tiny model is near uniform; docs/RELIABILITY.md has the rates on real
    models), so every 8 x 48-token group is caught."""
    other = tmp_path / "nearby"
    _nudged(tiny_dir, 0.05, 5).save_pretrained(other)
    tok.save_pretrained(other)
    requests = _long(_requests(tok))
    forged = [[s.token_ids for s in g] for g in _generate(other, requests)]
    results = [run(model, r, rescored(model, r, t)) for r, t in zip(requests, forged, strict=True)]
    assert all(not r.passed and r.reason.startswith("replay:") for r in results), [r.reason for r in results]
    honest = _generate(tiny_dir, requests)
    assert all(run(model, r, [(s.token_ids, s.logprobs) for s in g]).passed
               for r, g in zip(requests, honest, strict=True))


def test_a_near_tie_is_judged_by_the_groups_own_numerics(tiny_dir, tok, model, tmp_path):
    """The weights plus 0.1 % noise draw what the claimed model draws but for a few near ties, well inside the
    fp32 precision's margin (4e-3 nats), which alone passed them. The worker's logprobs match the audit's to
    1e-6, so its margin is the floor (1e-4), and those groups fail; honest groups still pass."""
    other = tmp_path / "nearby"
    _nudged(tiny_dir, 1e-3, 5).save_pretrained(other)
    tok.save_pretrained(other)
    requests = _long(_requests(tok))
    forged = [(r, rescored(model, r, [s.token_ids for s in g]))
              for r, g in zip(requests, _generate(other, requests), strict=True)]
    precision_only = AuditConfig(evidence_factor=math.inf)
    near = [(r, f) for r, f in forged if (a := run(model, r, f, precision_only)).passed and a.near_ties]
    assert near
    results = [run(model, r, f) for r, f in near]
    assert all(not r.passed and r.reason.startswith("replay:") for r in results), [r.reason for r in results]
    assert all(run(model, r, [(s.token_ids, s.logprobs) for s in g]).passed
               for r, g in zip(requests, _generate(tiny_dir, requests), strict=True))


def test_reported_noise_widens_the_margin_only_up_to_the_precisions_bound():
    config = AuditConfig()
    bound = config.margin("float32", 1.0)
    assert config.replay_margin("float32", 1.0, 0.0) == config.margin_floor
    assert config.replay_margin("float32", 1.0, 1e-4) == pytest.approx(config.evidence_factor * 1e-4)
    assert config.replay_margin("float32", 1.0, 0.4) == bound  # logprobs made noisy on purpose gain nothing more
    assert config.replay_margin("bfloat16", 0.5, 0.4) == config.margin("bfloat16", 0.5)
    # a shadow's rounding caps the margin where the reported logprobs would widen it, never widens it past them
    assert config.replay_margin("bfloat16", 1.0, 0.04, 0.002) == pytest.approx(config.evidence_factor * 0.002)
    assert config.replay_margin("bfloat16", 1.0, 0.001, 0.01) == pytest.approx(config.evidence_factor * 0.001)
    assert config.replay_margin("bfloat16", 1.0, 0.04, 0.0) == config.margin_floor
    # ... and replaces the table's bound: a model whose logits round by tenths of a nat in bf16 gets the room
    # its honest workers need, where the table's 0.5 nat struck them
    assert config.replay_margin("bfloat16", 1.0, 0.7, 0.5) == pytest.approx(config.evidence_factor * 0.5)
    assert config.replay_margin("bfloat16", 1.0, 0.7, math.nan) == config.margin("bfloat16", 1.0)


def test_a_shadows_rounding_sets_the_logprob_tolerance_and_the_supports_slack_where_it_is_more():
    config = AuditConfig()
    assert config.tolerance(None) == config.tolerance(0.01) == config.token_tol
    assert config.tolerance(0.5) == pytest.approx(4 * 0.5)  # SmolLM2 in bf16: logprobs off by up to 0.7 nat
    assert config.tolerance(math.inf) == config.token_tol
    bound = config.margin("bfloat16", 0.7)
    assert config.support_slack("bfloat16", 0.7, None) == config.support_slack("bfloat16", 0.7, 0.001) == (
        NUCLEUS_SLACK, bound)
    assert config.support_slack("bfloat16", 0.7, 0.3) == pytest.approx((math.expm1(0.6), config.evidence_factor * 0.3))
    assert config.support_slack("bfloat16", 0.7, 2.0)[0] == 1.0


def test_the_learners_auditor_re_scores_a_bf16_claim_with_its_shadow(tiny_dir, tok, model, tmp_path):
    """learner/auditor.py builds the shadow at the first group that claims bfloat16 and caps that group's margin
    with it: the disguised nearby model's groups (above) fail there as with `audit_group` given the shadow; a
    float32 claim gets no shadow."""
    auditor = _auditor(tiny_dir, model)
    requests = [r for r in _long(_requests(tok)) if (r.temperature, r.top_p, r.top_k) == (1.0, 1.0, 0)]
    groups = _disguised(tiny_dir, tok, model, tmp_path, requests)
    judged = [auditor.audit(_claimed(r, f, "bfloat16")) for r, f in groups]
    shadow = load_causal_lm(tiny_dir, dtype=torch.bfloat16).eval()
    assert [j.passed for j in judged] == [audit_group(model, claim(r, f, seed_of(r), "bfloat16"), None, shadow).passed
                                          for r, f in groups]
    assert all(j.rounding is not None for j in judged)
    assert sum(not j.passed for j in judged) > sum(not audit_group(model, claim(r, f, seed_of(r), "bfloat16")).passed
                                                   for r, f in groups)
    assert auditor.audit(_claimed(*groups[0], "float32")).rounding is None


def test_a_learner_whose_device_cannot_hold_the_shadow_audits_without_it(tiny_dir, model, honest, monkeypatch,
                                                                           caplog):
    """A worker's claim must not stop the learner: where the shadow does not fit (here the device's allocator
    refuses its weights), the group is judged by the claim's margin, as before shadows, and it is said once."""
    auditor = _auditor(tiny_dir, model)
    real = learner.auditor.load_causal_lm

    def no_room(path, dtype, **kwargs):
        if dtype == torch.bfloat16:
            raise torch.OutOfMemoryError("out of memory")  # what a full GPU's allocator raises
        return real(path, dtype=dtype, **kwargs)

    monkeypatch.setattr(learner.auditor, "load_causal_lm", no_room)
    request, samples = next((r, s) for r, s in honest if (r.temperature, r.top_p, r.top_k) == (1.0, 1.0, 0))
    results = [auditor.audit(_claimed(request, samples, "bfloat16")) for _ in range(2)]
    assert all(r.passed and r.rounding is None for r in results)
    assert [m for m in caplog.messages if "shadow" in m] == [
        "no memory on cpu for the audit's torch.bfloat16 shadow: groups claiming that precision are judged without it"]


def _disguised(tiny_dir, tok, model, tmp_path, requests) -> list:
    """(request, samples) a cheater claiming bf16 sends: drawn in float32 by the weights plus 5 % noise,
    rescored under the claimed weights, each logprob then given 0.03 nat of noise (never above 0)."""
    other = tmp_path / "nearby"
    _nudged(tiny_dir, 0.05, 5).save_pretrained(other)
    tok.save_pretrained(other)
    gen = torch.Generator().manual_seed(3)
    return [(r, [(t, (torch.tensor(lp) + 0.03 * torch.randn(len(lp), generator=gen)).clamp(max=0).tolist())
                 for t, lp in rescored(model, r, [s.token_ids for s in g])])
            for r, g in zip(requests, _generate(other, requests), strict=True)]


def _auditor(tiny_dir, model) -> Auditor:
    spec = JobSpec.model_validate({"name": "t", "base_model": str(tiny_dir), "task": {"name": "arithmetic"},
                                   "grpo": {"group_size": 8, "max_new_tokens": 48}})
    auditor = Auditor(str(tiny_dir), spec, fetch=lambda v: pytest.fail("no fetch expected"))
    auditor.remember(0, {k: v.clone() for k, v in model.state_dict().items()})
    return auditor


def _claimed(request, samples, precision: str) -> ClaimedGroup:
    return ClaimedGroup(rollout_id="rol_1", prompt_id=0, prompt_text="", reference=None, version=0,
                        worker_id="wrk_1", prompt_token_ids=request.prompt_token_ids, seed=seed_of(request),
                        precision=precision, samples=[SampleSubmit(token_ids=t, logprobs=lp, finish_reason="length")
                                                      for t, lp in samples])


def test_a_shadow_computes_in_the_precision_the_worker_and_the_auditor_do_not_share():
    assert shadow_dtype("float32", torch.float32) is None
    assert shadow_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert shadow_dtype("float16", torch.float32) == torch.float16
    assert shadow_dtype("bfloat16", torch.bfloat16) == torch.float32
    assert shadow_dtype("float32", torch.bfloat16) == torch.float32


def test_a_stale_version_fails_the_replay(tiny_dir, tok, model, tmp_path):
    """A worker that keeps sampling the version before, claims the current one and rescores its logprobs under
    it. The current version is the old one after one real GRPO step at the demo's learning rate."""
    old = copy.deepcopy(model)
    requests = _long(_requests(tok))
    drawn = _generate(tiny_dir, requests)
    rollouts = Rollouts()
    for g, (r, group) in enumerate(zip(requests, drawn, strict=True)):
        for k, s in enumerate(group):
            rollouts.add(r.prompt_token_ids, s.token_ids, s.logprobs, float(k % 2), g, 0)
    current = copy.deepcopy(model).train()
    grpo_update(current, torch.optim.AdamW(current.parameters(), lr=5e-4), rollouts, ObjectiveConfig())
    current.eval()
    results = [run(current, r, rescored(current, r, [s.token_ids for s in g]))
               for r, g in zip(requests, drawn, strict=True)]
    assert all(not r.passed and r.reason.startswith("replay:") for r in results), [r.reason for r in results]
    assert all(run(old, r, [(s.token_ids, s.logprobs) for s in g]).passed for r, g in zip(requests, drawn, strict=True))


def test_the_margin_covers_a_bf16_worker(tiny_dir, tok, model):
    """A worker computing in bfloat16 (here on the CPU) draws tokens the fp32 replay agrees with, within the
    bf16 margin, with the auditor's bf16 shadow or without it. The rounding the shadow measures (teacher forcing
    in bf16) is of the size of the worker's own difference from the audit (decoding in bf16 with a KV cache):
    0.6-1.4 times it here."""
    requests = _requests(tok)
    groups = _generate(tiny_dir, requests, dtype="bfloat16")
    shadow = load_causal_lm(tiny_dir, dtype=torch.bfloat16).eval()
    for with_shadow in (None, shadow):
        results = [audit_group(model, claim(r, [(s.token_ids, s.logprobs) for s in g], seed_of(r), "bfloat16"),
                               None, with_shadow) for r, g in zip(requests, groups, strict=True)]
        assert all(r.passed for r in results), [r.reason for r in results if not r.passed]
    assert all(0.25 < r.max_abs_diff / r.rounding < 4 for r in results), [(r.max_abs_diff, r.rounding) for r in results]


def test_a_worker_claiming_bf16_with_noisy_logprobs_gets_only_the_room_bf16_gives(tiny_dir, tok, model, tmp_path):
    """A cheater samples with a nearby model (5 % noise) in float32, rescores under the claimed weights, then
    claims bfloat16 and adds 0.03-nat noise to its logprobs: the margin, narrowed by how far its logprobs are
    from the audit's, widens toward bf16's bound and most of its groups pass. The bf16 shadow caps the margin at
    8 times what bf16 does to these tokens, the room an honest bf16 worker gets, and more of them fail."""
    disguised = _disguised(tiny_dir, tok, model, tmp_path, _long(_requests(tok)))
    shadow = load_causal_lm(tiny_dir, dtype=torch.bfloat16).eval()
    without = [audit_group(model, claim(r, f, seed_of(r), "bfloat16")) for r, f in disguised]
    capped = [audit_group(model, claim(r, f, seed_of(r), "bfloat16"), None, shadow) for r, f in disguised]
    assert all(r.rounding is None for r in without) and all(r.rounding < 0.02 for r in capped)
    config = AuditConfig()
    for a, b in zip(without, capped, strict=True):
        assert config.replay_margin("bfloat16", 1.0, b.max_abs_diff, b.rounding) <= config.evidence_factor * b.rounding
        assert a.passed or not b.passed  # r is small on the tiny model: the shadow only narrows here
    assert sum(not r.passed for r in capped) >= sum(not r.passed for r in without) + len(disguised) // 4
    assert all(r.reason.startswith("replay:") for r in capped if not r.passed)


def test_a_token_outside_the_nucleus_is_impossible(model, honest):
    request, samples = next((r, s) for r, s in honest if r.top_p < 1)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([request.prompt_token_ids])).logits[0, -1] / request.temperature
    rarest = int(logits.argmin())
    logprob = float(torch.log_softmax(logits, -1)[rarest])
    result = run(model, request, [([rarest], [logprob])] + samples[1:], seed=None)
    assert not result.passed and "outside the top-k/top-p nucleus" in result.reason


def test_hostile_but_valid_input_never_raises(model, honest):
    request, _ = honest[0]
    for samples in ([([V - 1] * 12, [-1e4] * 12)], [([0], [0.0])], [([5, 6], [0.0, -1e4])] * 8):
        assert not run(model, request, samples).passed


def test_a_copy_of_the_model_passes(tiny_dir, model, honest):
    twin = copy.deepcopy(model)
    for request, samples in honest[:3]:
        assert audit_group(twin, claim(request, samples, seed_of(request))).passed


@pytest.mark.slow
def test_honest_bf16_groups_of_a_real_model_pass_the_audit_with_its_shadow():
    """SmolLM2's logits are large enough that bf16 moves its logprobs by tenths of a nat: the table's fixed
    bounds (0.5 nat a logprob, 0.02 of top-p mass) struck honest bf16 workers' groups. With the shadow the audit
    allows what bf16 does on each group's tokens, and none of these is rejected (the worker's transformers backend
    in bf16 on the CPU, at the bench's settings: T = 0.7, top-p 0.9, 16 new tokens)."""
    from echo2.prompting import encode_prompt
    from transformers import AutoTokenizer

    from learner.tiny import import_smollm2

    cache = Path(__file__).resolve().parents[2] / ".echo2-cache" / "smollm2-135m-instruct"
    folder = cache if (cache / "config.json").exists() else import_smollm2(cache)
    tok = AutoTokenizer.from_pretrained(folder)
    rng = random.Random(1)
    bases = [rng.getrandbits(31) for _ in range(24)]
    requests = [GenRequest(prompt_token_ids=encode_prompt(tok, f"What is {10 + i}+{57 + 2 * i}? Answer with the "
                                                          "number only."), n=8, max_new_tokens=16, temperature=0.7,
                           top_p=0.9, seeds=[sample_seed(b, k) for k in range(8)]) for i, b in enumerate(bases)]
    groups = _generate(folder, requests, dtype="bfloat16")
    model = load_causal_lm(folder, dtype=torch.float32).eval()
    shadow = load_causal_lm(folder, dtype=torch.bfloat16).eval()
    claims = [GroupClaim(prompt=r.prompt_token_ids, samples=[(s.token_ids, s.logprobs) for s in g], temperature=0.7,
                         top_p=0.9, seed=b, precision="bfloat16")
              for r, g, b in zip(requests, groups, bases, strict=True)]
    results = [audit_group(model, c, None, shadow) for c in claims]
    assert all(r.passed for r in results), [r.reason for r in results if not r.passed]
    assert max(r.rounding for r in results) > 0.1  # bf16 rounds this model by tenths of a nat
    # No shadow, the table's fixed bounds: they struck 3 of these 24 until a nucleus edge counted only the tokens
    # more likely by more than the logprob slack before each (echo2.sampler._band_before); they pass them now too.
    table = [audit_group(model, c) for c in claims]
    assert all(r.passed for r in table), [r.reason for r in table if not r.passed]
