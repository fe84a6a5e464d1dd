"""The replayable sampler (echo2.sampler): exact integer noise, draws that depend on nothing but (logits,
settings, seed, position), the right distribution, and replays that tell an honest token from another."""

from __future__ import annotations

import pytest
import torch
from echo2 import sampler
from echo2.sampler import BLOCK, RowSettings, draw, hash32, replay
from scipy.stats import chisquare

V = 3 * BLOCK + 37  # several blocks, the last one short


def _settings(rows: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> RowSettings:
    return RowSettings.of([(temperature, top_k, top_p)] * rows, "cpu")


def _ids(values: list[int] | range) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def test_the_tensor_hash_is_the_reference_hash():
    values = [0, 1, 2, 255, 2**16 + 3, 2**31 - 1, 2**31, 2**32 - 1, 123456789, 0xDEADBEEF]
    hashed = sampler._hash32(torch.tensor(values, dtype=torch.int64))
    assert hashed.tolist() == [hash32(v) for v in values]
    assert len(set(hashed.tolist())) == len(values)


def test_a_draw_depends_only_on_its_own_row():
    torch.manual_seed(0)
    logits = torch.randn(6, V) * 3
    seeds, positions = _ids([11, 12, 13, 14, 15, 16]), _ids([0, 1, 2, 3, 4, 5])
    together, lp_together = draw(logits, _settings(6), seeds, positions)
    for r in range(6):
        alone, lp_alone = draw(logits[r : r + 1], _settings(1), seeds[r : r + 1], positions[r : r + 1])
        assert alone.item() == together[r].item()
        assert lp_alone.item() == pytest.approx(lp_together[r].item(), abs=1e-6)
    again, _ = draw(logits, _settings(6), seeds, positions)
    assert torch.equal(again, together)


def test_seeds_and_positions_change_the_draw():
    logits = torch.zeros(400, V)  # uniform: every draw is noise alone
    by_seed, _ = draw(logits, _settings(400), _ids(range(400)), _ids([7] * 400))
    by_position, _ = draw(logits, _settings(400), _ids([7] * 400), _ids(range(400)))
    assert len(set(by_seed.tolist())) > 300
    assert len(set(by_position.tolist())) > 300


def test_the_reported_logprob_is_before_truncation():
    torch.manual_seed(1)
    logits = torch.randn(32, V) * 2
    settings = _settings(32, temperature=0.7, top_k=50, top_p=0.8)
    tokens, lp = draw(logits, settings, _ids(range(32)), _ids([3] * 32))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(lp, expected, atol=1e-5)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.0, 0, 0.7),
                                                              (1.3, 40, 1.0), (1.0, 60, 0.9)])
def test_draws_over_many_seeds_follow_the_distribution(temperature, top_k, top_p):
    """Goodness of fit: 40,000 seeds, one draw each, against the categorical the settings define."""
    gen = torch.Generator().manual_seed(42)
    logits = torch.randn(V, generator=gen) * 2.0
    logits[5] += 4.0  # one dominant token, and many rare ones across every block
    n = 40_000
    settings = _settings(n, temperature, top_k, top_p)
    tokens, _ = draw(logits.expand(n, V), settings, _ids(range(n)), _ids([9] * n))
    expected = sampler.support(sampler.logprobs(logits.unsqueeze(0), _settings(1, temperature, top_k, top_p)),
                               _settings(1, temperature, top_k, top_p)).exp().squeeze(0)
    expected = expected / expected.sum()
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[expected == 0].sum() == 0, "a token outside the support was drawn"
    # Pool the rare tokens (expected count < 5) into one cell, as the chi-square test requires.
    exp_counts = expected.double() * n
    big = exp_counts >= 5
    obs = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
    exp = torch.cat([exp_counts[big], exp_counts[~big].sum().unsqueeze(0)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    assert chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue > 1e-4


def test_greedy_rows_take_the_argmax():
    torch.manual_seed(2)
    logits = torch.randn(5, V)
    tokens, lp = draw(logits, _settings(5, temperature=0.0), _ids(range(5)), _ids([0] * 5))
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1))


@pytest.mark.parametrize("rows", [[(0.7, 0, 0.9), (1.0, 0, 1.0)], [(0.0, 0, 1.0), (1.0, 5, 1.0)]])
def test_settings_known_up_front_draw_as_settings_read_from_the_tensors(rows):
    """RowSettings.of notes whether any row truncates or is greedy (a decode loop on a GPU would otherwise sync
    twice per token to read it); the draw is the same as with settings that leave it to the tensors."""
    torch.manual_seed(4)
    logits = torch.randn(2, V)
    known = RowSettings.of(rows, "cpu")
    assert (known.any_truncation, known.any_greedy) == (any(k > 0 or p < 1 for _, k, p in rows),
                                                      any(t <= 0 for t, _, _ in rows))
    read = RowSettings(known.temperature, known.top_k, known.top_p)
    assert (read.truncates(), read.has_greedy()) == (known.truncates(), known.has_greedy())
    for a, b in zip(draw(logits, known, _ids([1, 2]), _ids([3, 3])), draw(logits, read, _ids([1, 2]), _ids([3, 3])),
                    strict=True):
        assert torch.equal(a, b)


def test_an_honest_token_replays_with_no_gap_and_within_twice_the_logit_error():
    torch.manual_seed(3)
    n = 2_000
    logits = torch.randn(n, V) * 3
    seeds, positions = _ids(range(n)), _ids([i % 50 for i in range(n)])
    tokens, _ = draw(logits, _settings(n), seeds, positions)
    exact = replay(logits, tokens, _settings(n), seeds, positions)
    assert float(exact.gap.max()) == 0.0 and not bool(exact.outside.any())
    assert torch.equal(exact.chosen, tokens)
    eps = 1e-2
    noisy = replay(logits + (torch.rand(n, V) * 2 - 1) * eps, tokens, _settings(n), seeds, positions)
    assert float(noisy.gap.max()) <= 2 * eps + 1e-5


def test_a_token_drawn_with_another_seed_or_model_does_not_replay():
    torch.manual_seed(4)
    n = 2_000
    logits = torch.randn(n, V) * 3
    seeds, positions = _ids(range(n)), _ids([0] * n)
    other_seed, _ = draw(logits, _settings(n), seeds + 1, positions)
    other_model, _ = draw(logits + torch.randn(n, V), _settings(n), seeds, positions)
    for tokens in (other_seed, other_model):
        result = replay(logits, tokens, _settings(n), seeds, positions)
        differs = tokens != result.chosen
        assert float(differs.float().mean()) > 0.3
        assert bool((result.gap[differs] > 0).all())


def test_a_replay_given_the_callers_supports_is_the_same_replay():
    """The audit hands the replay the ranking and supports it computed for its own tests."""
    torch.manual_seed(5)
    n = 64
    logits = torch.randn(n, V) * 3
    settings = _settings(n, temperature=0.7, top_k=40, top_p=0.9)
    seeds, positions = _ids(range(n)), _ids([i % 7 for i in range(n)])
    tokens, _ = draw(logits + torch.randn(n, V) * 0.1, settings, seeds, positions)
    lp = sampler.logprobs(logits, settings)
    ranks = sampler.ranked(lp)
    given = replay(logits, tokens, settings, seeds, positions, 0.02, 0.1, lp=lp, ranks=ranks,
                   exact=sampler.support(lp, settings, ranks=ranks),
                   wide=sampler.support(lp, settings, 0.02, 0.1, ranks))
    alone = replay(logits, tokens, settings, seeds, positions, 0.02, 0.1)
    assert torch.equal(given.gap, alone.gap) and torch.equal(given.chosen, alone.chosen)
    assert torch.equal(given.outside, alone.outside) and bool((given.gap > 0).any())


def test_a_token_outside_the_support_is_outside():
    logits = torch.zeros(1, V)
    logits[0, 3] = 10.0
    result = replay(logits, _ids([500]), _settings(1, top_k=1), _ids([1]), _ids([0]))
    assert bool(result.outside.item()) and result.gap.item() == float("inf")


@pytest.mark.parametrize("slacks", [(0.0, 0.0), (0.02, 0.3), (-0.02, -0.3)])
def test_a_support_from_the_ranked_prefix_is_the_support_from_the_whole_ranking(slacks):
    """On a CPU only the first PREFIX tokens are ranked; rows whose support reaches past them (a flat row at
    top-p 0.95, a top-k beyond the prefix) make the support rank the rest, and every row's support is the one the
    whole ranking gives, bit for bit."""
    torch.manual_seed(6)
    v = 3 * sampler.PREFIX + 77
    peaked, flat = torch.randn(8, v) * 6, torch.randn(2, v) * 0.1
    rows = [(0.7, 0, 0.9), (1.0, 40, 0.95), (1.0, 0, 1.0), (0.5, 5, 1.0)] * 2
    for logits, settings in ((peaked, rows), (torch.cat([peaked, flat]), [*rows, (1.0, 0, 0.95), (1.0, 0, 0.9)]),
                             (peaked[:2], [(1.0, 2 * sampler.PREFIX, 1.0), (0.7, 0, 0.9)])):
        one = RowSettings.of(settings, "cpu")
        lp = sampler.logprobs(logits, one)
        ranks = sampler.ranked(lp)
        assert not ranks.complete() and ranks.top.shape[-1] == sampler.PREFIX
        prefix = sampler.support(lp, one, *slacks, ranks=ranks)
        assert torch.equal(prefix, sampler.support(lp, one, *slacks, ranks=ranks.full()))
        for r in range(len(settings)):  # and each row's support is its own, whatever its batch-mates need
            alone = RowSettings.of([settings[r]], "cpu")
            assert torch.equal(prefix[r], sampler.support(lp[r : r + 1], alone, *slacks)[0])


def test_a_row_that_does_not_truncate_keeps_every_token_beside_rows_that_do():
    torch.manual_seed(7)
    logits = torch.randn(2, V) * 8  # a long tail of tokens whose mass is below float32's resolution of 1
    settings = RowSettings.of([(1.0, 0, 1.0), (0.7, 0, 0.9)], "cpu")
    lp = sampler.logprobs(logits, settings)
    for slacks in ((0.0, 0.0), (-0.02, -0.3)):
        kept = sampler.support(lp, settings, *slacks)
        assert torch.equal(kept[0], lp[0]) and bool(torch.isinf(kept[1]).any())
