"""Per-token logprobs, padding, micro-batches and the learner's sampler (learner.policy.sample over
learner/sampling.py), on the real tiny model."""

from __future__ import annotations

import pytest
import torch
from echo2.loading import load_causal_lm
from echo2.sampler import RowSettings

from learner.objective import ObjectiveConfig
from learner.policy import (
    Rollouts,
    completion_logits,
    completion_logprobs,
    grpo_update,
    micro_batches,
    pad_batch,
    pad_values,
    sample,
    support_logprobs,
)


def _naive_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """One unpadded sequence, full log-softmax: the definition the batched path must match."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(prompt)
    return [logprobs[start + j - 1, tok].item() for j, tok in enumerate(completion)]


def test_pad_batch_layout():
    batch = pad_batch([[5, 6, 7], [8]], [[1, 2], [3, 4, 0]], pad_id=9)
    assert batch.prompt_len == 3 and batch.completion_len == 3
    assert batch.input_ids.tolist() == [[5, 6, 7, 1, 2, 9], [9, 9, 8, 3, 4, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert batch.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert pad_values([[0.5], [1.0, 2.0]], 3).tolist() == [[0.5, 0, 0], [1.0, 2.0, 0]]
    with pytest.raises(ValueError):
        pad_batch([[]], [[1]], pad_id=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_batched_logprobs_match_unpadded_sequences(tiny, temperature):
    model, tok = tiny
    prompts = [tok("3+4=")["input_ids"], tok("what is 12*7?\n")["input_ids"], tok("1=")["input_ids"]]
    completions = [tok("7")["input_ids"] + [tok.eos_token_id], tok("84 so")["input_ids"], []]
    batch = pad_batch(prompts, completions, tok.pad_token_id)
    with torch.no_grad():
        got = completion_logprobs(model, batch, temperature=temperature)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        assert got[i, : len(c)].tolist() == pytest.approx(_naive_logprobs(model, p, c, temperature), abs=1e-5)
        assert got[i, len(c) :].abs().sum().item() == 0.0


def test_sampler_logprobs_are_the_behaviour_logprobs(tiny):
    """What a worker reports must equal what the learner recomputes (same definition, same positions)."""
    model, tok = tiny
    prompts = [tok(t)["input_ids"] for t in ["3+4=", "what is 2*3?\n", "0+0=", "44+1="]]
    samples = sample(model, prompts, max_new_tokens=6, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                     temperature=0.9, seed=1)
    batch = pad_batch(prompts, [s.completion_ids for s in samples], tok.pad_token_id)
    with torch.no_grad():
        learner_lp = completion_logprobs(model, batch, temperature=0.9)
    behaviour = pad_values([s.logprobs for s in samples], batch.completion_len)
    assert torch.allclose(learner_lp, behaviour, atol=1e-4)
    for s in samples:
        assert len(s.completion_ids) == len(s.logprobs) <= 6
        assert s.finished == (tok.eos_token_id in s.completion_ids)
        if s.finished:
            assert s.completion_ids[-1] == tok.eos_token_id


def test_the_learners_draws_and_a_tinker_request_with_the_same_seed_are_one_sampler(tiny):
    """learner.policy.sample seeds row i with sample_seed(seed, i); a Tinker request of n samples seeds its k-th
    with sample_seed(seed, k): the same prompt n times and one request of n samples draw the same tokens."""
    from echo2.protocol.tinker import SampleParams, SamplePayload

    from learner.sampling import sample as tinker_sample

    model, tok = tiny
    prompt = tok("3 + 4 =")["input_ids"]
    rows = sample(model, [prompt] * 4, max_new_tokens=12, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                  temperature=0.9, seed=7)
    params = SampleParams(max_tokens=12, temperature=0.9, seed=7, stop_tokens=[tok.eos_token_id])
    [result] = tinker_sample(model, tok, [SamplePayload(prompt=prompt, num_samples=4, params=params)],
                             tok.eos_token_id)
    assert [s.tokens for s in result.sequences] == [r.completion_ids for r in rows]
    assert [s.logprobs for s in result.sequences] == [r.logprobs for r in rows]
    assert [s.stop_reason == "stop" for s in result.sequences] == [r.finished for r in rows]


def test_sampler_is_seeded_and_greedy_is_deterministic(tiny):
    model, tok = tiny
    prompts = [tok("3+4=")["input_ids"]] * 3
    kw = {"max_new_tokens": 4, "eos_id": tok.eos_token_id, "pad_id": tok.pad_token_id}
    a = sample(model, prompts, temperature=1.0, seed=5, **kw)
    b = sample(model, prompts, temperature=1.0, seed=5, **kw)
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    g = sample(model, prompts, temperature=0.0, **kw)
    assert g[0].completion_ids == g[1].completion_ids == g[2].completion_ids


def test_micro_batches_respect_the_token_budget():
    lengths = [5, 50, 7, 6, 49, 8, 200]
    batches = micro_batches(lengths, max_tokens=100)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 100
    assert [6] in batches  # longer than the budget: alone
    with pytest.raises(ValueError):
        micro_batches(lengths, 0)


def test_select_trims_and_keeps_logprobs(tiny):
    model, tok = tiny
    prompts = [tok("1+1=")["input_ids"], tok("what is 1+1?\n")["input_ids"], tok("2=")["input_ids"]]
    completions = [tok("2")["input_ids"], tok("2 so the answer")["input_ids"], tok("3")["input_ids"]]
    batch = pad_batch(prompts, completions, tok.pad_token_id)
    with torch.no_grad():
        full = completion_logprobs(model, batch)
        sub_batch = batch.select([0, 2])
        sub = completion_logprobs(model, sub_batch)
    assert sub_batch.input_ids.shape[1] < batch.input_ids.shape[1]
    assert torch.allclose(sub, full[[0, 2], : sub.shape[1]], atol=1e-5)


def test_gradient_accumulation_matches_full_batch(tiny_dir):
    """Micro-batched backward with the global divisor == one full-batch backward."""
    from transformers import AutoTokenizer

    from learner.objective import ObjectiveConfig, grpo_loss, loss_denominator

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    prompts = [tok(t)["input_ids"] for t in ["1+2=", "what is 3*3?\n", "4-1=", "2+2="]]
    completions = [tok(t)["input_ids"] for t in ["3", "9 so", "3", "4 4"]]
    batch = pad_batch(prompts, completions, tok.pad_token_id)
    adv, stale = torch.tensor([1.0, -0.5, 0.3, -0.8]), torch.tensor([0, 1, 0, 2])
    cfg = ObjectiveConfig()
    keep = torch.ones(4, dtype=torch.bool)
    split = micro_batches([len(c) + len(p) for p, c in zip(prompts, completions, strict=True)], 12)
    assert len(split) > 1
    grads = []
    for groups in ([[0, 1, 2, 3]], split):
        model = load_causal_lm(tiny_dir, dtype=torch.float32)
        denom = loss_denominator(batch.completion_mask, keep, cfg)
        for rows in groups:
            mb = batch.select(rows)
            lp = completion_logprobs(model, mb)
            behaviour = lp.detach() - 0.1
            loss, _ = grpo_loss(lp, behaviour, adv[rows], mb.completion_mask, stale[rows], cfg, denominator=denom)
            loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_activation_checkpointing_gives_the_same_gradients(tiny_dir):
    """The job option learner.activation_checkpointing recomputes activations in backward: same maths."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    batch = pad_batch([tok("1+2=")["input_ids"], tok("4-1=")["input_ids"]], [tok("3")["input_ids"],
                      tok("3 3")["input_ids"]], tok.pad_token_id)
    grads = []
    for checkpointed in (False, True):
        model = load_causal_lm(tiny_dir, dtype=torch.float32).train()
        if checkpointed:
            model.gradient_checkpointing_enable()
        (completion_logprobs(model, batch) * batch.completion_mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def test_grpo_update_steps_only_on_signal(tiny_dir):
    from transformers import AutoTokenizer

    from learner.objective import ObjectiveConfig
    from learner.policy import Rollouts, grpo_update

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = load_causal_lm(tiny_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prompts = [tok("1+1=")["input_ids"]] * 2 + [tok("2+2=")["input_ids"]] * 2
    model.eval()
    out = sample(model, prompts, max_new_tokens=3, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                 seed=0)
    before = [p.detach().clone() for p in model.parameters()]

    def rollouts(rewards):
        return Rollouts(prompts, [s.completion_ids for s in out], [s.logprobs for s in out], rewards,
                        [0, 0, 1, 1], [0, 0, 1, 1])

    flat = grpo_update(model, opt, rollouts([1.0, 1.0, 0.0, 0.0]), ObjectiveConfig(), pad_id=tok.pad_token_id)
    assert flat == {"stepped": 0.0, "dropped_groups": 2.0, "kept_samples": 0.0, "poisoned_groups": [],
                    "mismatch": []}
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))

    stats = grpo_update(model, opt, rollouts([1.0, 0.0, 0.0, 0.0]), ObjectiveConfig(), pad_id=tok.pad_token_id,
                        max_tokens_per_micro_batch=1)
    assert stats["stepped"] == 1.0 and stats["dropped_groups"] == 1.0 and stats["kept_samples"] == 2.0
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy: learner recomputes the same logprobs
    assert stats["clip_frac"] == 0.0 and stats["grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def _update_with(tiny_dir, poison):
    """One grpo_update of three groups of two samples; `poison(behaviour)` forges group 1's logprobs."""
    from transformers import AutoTokenizer

    from learner.objective import ObjectiveConfig
    from learner.policy import Rollouts, grpo_update

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = load_causal_lm(tiny_dir, dtype=torch.float32)
    prompts = [tok(f"{i}+{i}=")["input_ids"] for i in range(3) for _ in range(2)]
    model.eval()
    out = sample(model, prompts, max_new_tokens=4, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                 seed=0)
    behaviour = [list(s.logprobs) for s in out]
    poison(behaviour)
    rollouts = Rollouts(prompts, [s.completion_ids for s in out], behaviour, [1.0, 0.0] * 3, [0, 0, 1, 1, 2, 2],
                        [0] * 6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stats = grpo_update(model, opt, rollouts, ObjectiveConfig(), pad_id=tok.pad_token_id)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return stats


def test_forged_logprobs_cannot_overflow_the_loss(tiny_dir):
    def forge(behaviour):  # finding 1: logprobs of -1e4 made exp(logp - logq) inf and the loss inf
        behaviour[2] = [-1e4] * len(behaviour[2])
        behaviour[3] = [-1e4] * len(behaviour[3])

    stats = _update_with(tiny_dir, forge)
    assert stats["stepped"] == 1.0 and stats["poisoned_groups"] == []
    assert abs(stats["loss"]) <= 10.0 + 1e-6  # ratio capped at FRESH_CAP = 10, |A| = 1 for rewards 1 and 0


def test_a_group_whose_loss_is_not_finite_is_dropped_and_the_step_goes_on(tiny_dir):
    def forge(behaviour):  # a value the door would refuse, standing for anything that slips through
        behaviour[3][0] = float("nan")

    stats = _update_with(tiny_dir, forge)
    assert stats["poisoned_groups"] == [1] and stats["stepped"] == 1.0 and stats["kept_samples"] == 4.0


def _perturbed(model, scale: float, seed: int = 0):
    import copy

    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return other


def _rows_from(behaviour_model, tok, stale: int = 0) -> Rollouts:
    prompts = [tok(t)["input_ids"] for t in ["3+4=", "12+7=", "5+5=", "9+1=", "2+2=", "8+8="]]
    out = sample(behaviour_model, prompts, max_new_tokens=6, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                 seed=3)
    return Rollouts([list(p) for p in prompts], [s.completion_ids for s in out], [s.logprobs for s in out],
                    [1.0, 0.0, 1.0, 0.0, 0.5, 0.0], [0, 0, 1, 1, 2, 2], [stale] * 6)


@pytest.mark.parametrize("kind", ["tis", "mis", "icepop"])
def test_mismatch_moves_when_the_behaviour_policy_is_perturbed(tiny, kind):
    """Behaviour = the learner's own weights: KL 0, ESS 1, nothing clipped or masked. Behaviour = the same
    weights plus noise (another policy): KL up, ESS down, and the correction clips (tis) or masks (mis,
    icepop) tokens. Each statistic is reported for the staleness the rows have, and for all."""
    import copy

    model, tok = tiny
    cfg = ObjectiveConfig(correction=kind, correction_low=0.8, correction_high=1.25, max_staleness=1)
    seen = {}
    for name, behaviour in (("same", model), ("perturbed", _perturbed(model, 0.05))):
        trained = copy.deepcopy(model)
        stats = grpo_update(trained, torch.optim.SGD(trained.parameters(), lr=0.0), _rows_from(behaviour, tok, 1),
                            cfg, pad_id=tok.pad_token_id)
        rows = {r["staleness"]: r for r in stats["mismatch"]}
        assert set(rows) == {1, -1} and {**rows[1], "staleness": -1} == rows[-1]
        seen[name] = rows[-1]
    same, moved = seen["same"], seen["perturbed"]
    assert same["kl"] < 1e-8 and same["ess"] == pytest.approx(1.0) and same["clipped"] == same["masked"] == 0.0
    assert moved["kl"] > 1e-3 and moved["ess"] < 0.99
    assert (moved["clipped"] if kind == "tis" else moved["masked"]) > 0.05


@pytest.mark.parametrize("kind", ["tis", "mis", "icepop"])
def test_each_correction_is_applied_in_the_update(tiny, kind):
    """Behaviour logprobs 1 nat below the learner's (w = e > H = 2): mis and icepop mask every token, so the
    step changes no weight; tis truncates every weight to 2, so its update is twice the uncorrected one at
    w = 1 (with SGD, whose step is linear in the gradient)."""
    import copy

    model, tok = tiny
    rows = _rows_from(model, tok)
    lowered = Rollouts(rows.prompt_ids, rows.completion_ids, [[x - 1.0 for x in lp] for lp in rows.behaviour_logprobs],
                       rows.rewards, rows.group_ids, rows.staleness)

    def moved(rollouts, correction):
        trained = copy.deepcopy(model)
        grpo_update(trained, torch.optim.SGD(trained.parameters(), lr=1e-2), rollouts,
                    ObjectiveConfig(correction=correction, correction_high=2.0), pad_id=tok.pad_token_id,
                    grad_clip=None)
        return torch.cat([(a - b).flatten() for a, b in zip(trained.parameters(), model.parameters(), strict=True)])

    corrected, plain = moved(lowered, kind), moved(rows, "none")
    assert plain.abs().max() > 0
    if kind == "tis":
        assert torch.allclose(corrected, 2 * plain, atol=1e-6)
    else:
        assert corrected.abs().max() == 0


def test_support_replay_masks_tokens_outside_the_sampler_support(tiny):
    """top_k = 20 of the tiny model's 96 tokens: log Z is the logsumexp of the 20 most likely tokens'
    logprobs; tokens sampled at T = 1 from the whole vocabulary fall outside it in part, get weight 0 and are
    counted as masked."""
    import copy

    model, tok = tiny
    rows = _rows_from(model, tok)
    trained = copy.deepcopy(model)
    stats = grpo_update(trained, torch.optim.SGD(trained.parameters(), lr=0.0), rows, ObjectiveConfig(),
                        pad_id=tok.pad_token_id, support=(20, 1.0))
    batch = pad_batch(rows.prompt_ids, rows.completion_ids, tok.pad_token_id)
    with torch.no_grad():
        lp, log_mass, outside = support_logprobs(model, batch, RowSettings.of([(1.0, 20, 1.0)], "cpu"))
        full = torch.log_softmax(completion_logits(model, batch, 1.0), dim=-1)
    real = batch.completion_mask > 0
    expected = torch.logsumexp(full.topk(20, dim=-1).values, dim=-1)
    assert torch.allclose(log_mass[real], expected[real], atol=1e-5)
    targets = batch.input_ids[:, -batch.completion_len:]
    rank = (full > full.gather(-1, targets.unsqueeze(-1))).sum(-1)  # tokens more likely than the one drawn
    assert torch.equal(outside, (rank >= 20) & real)
    whole = stats["mismatch"][-1]
    assert 0 < whole["masked"] < 1
    assert whole["masked"] == pytest.approx(float(outside.sum()) / float(real.sum()), abs=1e-6)
