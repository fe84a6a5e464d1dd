"""The GRPO objective against hand-computed values (see learner/objective.py for the formulas)."""

from __future__ import annotations

import math

import pytest
import torch

from learner.objective import ObjectiveConfig, group_advantages, grpo_loss, loss_denominator, mismatch_summary

LN = math.log


def _one_token(ratio: float, adv: float, *, stale: int = 0, cfg: ObjectiveConfig | None = None):
    cfg = cfg or ObjectiveConfig(eps_low=0.2, eps_high=0.28, ratio_cap=2.0)
    logp = torch.tensor([[LN(ratio)]], requires_grad=True)
    loss, stats = grpo_loss(
        logp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), torch.tensor([stale]), cfg
    )
    loss.backward()
    return loss.item(), stats, logp.grad.item()


def test_group_advantages_with_and_without_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2])
    adv = group_advantages(rewards, groups, scale_by_std=True, eps=0.0)
    s = math.sqrt(1 / 6)  # population std of (0, 0.5, 1)
    expected = [1, -1, -1, 1, 0, 0, -0.5 / s, 0, 0.5 / s]
    assert adv.advantages.tolist() == pytest.approx(expected, abs=1e-6)
    assert adv.keep.tolist() == [True] * 4 + [False] * 2 + [True] * 3
    assert adv.dropped_groups == [1] and adv.num_dropped == 1

    plain = group_advantages(rewards, groups, scale_by_std=False)
    assert plain.advantages.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, -0.5, 0, 0.5])


def test_all_groups_equal_are_all_dropped():
    adv = group_advantages(torch.tensor([0.0, 0.0, 1.0, 1.0]), torch.tensor([3, 3, 7, 7]))
    assert adv.dropped_groups == [3, 7]
    assert not adv.keep.any()
    loss, stats = grpo_loss(
        torch.zeros(4, 2, requires_grad=True), torch.zeros(4, 2), adv.advantages, torch.ones(4, 2),
        torch.zeros(4), ObjectiveConfig(), keep=adv.keep,
    )
    assert loss.item() == 0.0 and stats["tokens"] == 0.0


@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "clipped"),
    [
        (1.5, 1.0, -1.28, True),  # upper clip at 1 + eps_high
        (0.5, -1.0, 0.8, True),  # lower clip at 1 - eps_low
        (0.5, 1.0, -0.5, False),  # min() keeps the smaller, unclipped term
        (1.5, -1.0, 1.5, False),  # fresh sample: no cap, PPO leaves large ratios with A < 0 alone
        (1.1, 1.0, -1.1, False),  # inside the trust region
    ],
)
def test_two_sided_clipping(ratio, adv, loss, clipped):
    value, stats, grad = _one_token(ratio, adv)
    assert value == pytest.approx(loss, abs=1e-6)
    assert stats["clip_frac"] == (1.0 if clipped else 0.0)
    # d(-ratio*A)/d(logp) = -ratio*A when unclipped; no gradient through a clipped term
    assert grad == pytest.approx(0.0 if clipped else -ratio * adv, abs=1e-6)


def test_ratio_cap_applies_to_stale_samples_only():
    fresh, fresh_stats, _ = _one_token(3.0, -1.0, stale=0)
    stale, stale_stats, grad = _one_token(3.0, -1.0, stale=2)
    assert fresh == pytest.approx(3.0) and fresh_stats["cap_frac"] == 0.0
    assert stale == pytest.approx(2.0) and stale_stats["cap_frac"] == 1.0
    assert stale_stats["ratio_mean"] == pytest.approx(2.0)
    assert grad == 0.0
    below, below_stats, _ = _one_token(1.5, -1.0, stale=1)  # under the cap: unchanged
    assert below == pytest.approx(1.5) and below_stats["cap_frac"] == 0.0


def test_padding_is_ignored():
    cfg = ObjectiveConfig()
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    logp = torch.tensor([[LN(1.1), LN(0.9), 50.0], [LN(1.05), -50.0, 7.0]])
    loss, stats = grpo_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask, torch.zeros(2), cfg)
    # tokens: +1*1.1, +1*0.9, -1*1.05 -> loss = -(1.1 + 0.9 - 1.05) / 3
    assert loss.item() == pytest.approx(-(1.1 + 0.9 - 1.05) / 3)
    assert stats["tokens"] == 3.0
    assert stats["ratio_mean"] == pytest.approx((1.1 + 0.9 + 1.05) / 3)


def _norm_case(length_norm: str, max_len: int | None = None) -> float:
    cfg = ObjectiveConfig(length_norm=length_norm, max_len=max_len)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # ratio 1 everywhere, so each token's loss is -A_i; sample 3 belongs to a dropped group
    adv = torch.tensor([2.0, -1.0, 5.0])
    keep = torch.tensor([True, True, False])
    loss, _ = grpo_loss(torch.zeros(3, 3), torch.zeros(3, 3), adv, mask, torch.zeros(3), cfg, keep=keep)
    return loss.item()


def test_length_normalisations():
    # kept tokens: sample 1 has 1 token at -2, sample 2 has 3 tokens at +1
    assert _norm_case("token_mean") == pytest.approx((-2 + 3) / 4)
    assert _norm_case("seq_mean") == pytest.approx((-2 / 1 + 3 / 3) / 2)
    assert _norm_case("max_len", max_len=8) == pytest.approx((-2 + 3) / (2 * 8))


def test_kl_k3_to_reference():
    cfg = ObjectiveConfig(kl_coef=0.5)
    logp = torch.tensor([[0.0]])
    ref = torch.tensor([[LN(2.0)]])  # log(ref / p) = ln 2 -> k3 = 2 - ln 2 - 1
    k3 = 1.0 - LN(2.0)
    loss, stats = grpo_loss(
        logp, torch.zeros(1, 1), torch.tensor([0.0]), torch.ones(1, 1), torch.zeros(1), cfg, ref_logprobs=ref
    )
    assert stats["kl"] == pytest.approx(k3)
    assert loss.item() == pytest.approx(0.5 * k3)
    no_coef, stats0 = grpo_loss(
        logp, torch.zeros(1, 1), torch.tensor([0.0]), torch.ones(1, 1), torch.zeros(1), ObjectiveConfig(),
        ref_logprobs=ref,
    )
    assert no_coef.item() == 0.0 and stats0["kl"] == pytest.approx(k3)  # reported, not trained


@pytest.mark.parametrize("length_norm", ["token_mean", "seq_mean", "max_len"])
def test_micro_batches_sum_to_the_full_batch(length_norm):
    torch.manual_seed(0)
    cfg = ObjectiveConfig(length_norm=length_norm, max_len=6, kl_coef=0.1)
    n, t = 6, 5
    mask = (torch.arange(t).unsqueeze(0) < torch.tensor([1, 5, 3, 2, 4, 5]).unsqueeze(1)).float()
    base = torch.randn(n, t) * 0.3
    behaviour, ref = torch.randn(n, t) * 0.3, torch.randn(n, t) * 0.3
    adv, stale = torch.randn(n), torch.tensor([0, 1, 0, 2, 0, 1])
    keep = torch.tensor([True, True, False, True, True, True])

    full_logp = base.clone().requires_grad_(True)
    full, _ = grpo_loss(full_logp, behaviour, adv, mask, stale, cfg, keep=keep, ref_logprobs=ref)
    full.backward()

    denom = loss_denominator(mask, keep, cfg)
    parts_logp = base.clone().requires_grad_(True)
    total = 0.0
    for rows in ([0, 1], [2, 3, 4], [5]):
        idx = torch.tensor(rows)
        part, _ = grpo_loss(
            parts_logp[idx], behaviour[idx], adv[idx], mask[idx], stale[idx], cfg,
            keep=keep[idx], ref_logprobs=ref[idx], denominator=denom,
        )
        part.backward()
        total += part.item()
    assert total == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(parts_logp.grad, full_logp.grad, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs",
    [{"eps_low": 1.0}, {"eps_high": -0.1}, {"ratio_cap": 0.5}, {"kl_coef": -1.0},
     {"length_norm": "max_len"}, {"length_norm": "nope"}],
)
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        ObjectiveConfig(**kwargs)


def test_the_learning_rate_warms_up_then_follows_its_schedule():
    from echo2.protocol import JobSpec

    from learner.trainer import lr_factor

    def spec(schedule: str) -> JobSpec:
        return JobSpec.model_validate({"name": "x", "base_model": "echo2:tiny", "task": {"name": "arithmetic"},
                                       "max_steps": 12, "grpo": {"warmup_steps": 2, "lr_schedule": schedule,
                                                                 "min_lr_ratio": 0.1}})

    assert [lr_factor(s, spec("constant")) for s in (0, 1, 2, 11)] == [0.5, 1.0, 1.0, 1.0]
    linear = [lr_factor(s, spec("linear")) for s in (2, 7, 12)]
    assert linear == pytest.approx([1.0, 0.55, 0.1])
    cosine = [lr_factor(s, spec("cosine")) for s in (2, 7, 12)]
    assert cosine == pytest.approx([1.0, 0.55, 0.1])
    assert lr_factor(4, spec("cosine")) > lr_factor(4, spec("linear"))  # cosine stays high longer


def test_the_trainer_builds_the_optimiser_the_job_states(tiny):
    from echo2.protocol import JobSpec

    from learner.trainer import GRPOTrainer

    model, tok = tiny
    spec = JobSpec.model_validate({"name": "x", "base_model": "echo2:tiny", "task": {"name": "arithmetic"},
                                   "grpo": {"lr": 5e-4, "adam_betas": [0.9, 0.99], "weight_decay": 0.01,
                                            "adam_eps": 1e-6}})
    opt = GRPOTrainer(model, tok, spec).optimizer
    assert opt.defaults["betas"] == (0.9, 0.99) and opt.defaults["weight_decay"] == 0.01
    assert opt.defaults["eps"] == 1e-6 and opt.param_groups[0]["lr"] == 5e-4


# ---- off-policy corrections (step 2b) and the mismatch statistics (step 6), by hand -------------------------

def _corrected(w: list[float], adv: float, cfg: ObjectiveConfig, staleness: list[int] | None = None):
    """One sample, one token per w: logp = 0 (logold = 0), logq = -ln w, so the weight's w is exactly w."""
    logp = torch.zeros(1, len(w), requires_grad=True)
    logq = torch.tensor([[-LN(x) for x in w]])
    stale = torch.tensor([staleness or [0] * len(w)])
    loss, stats = grpo_loss(logp, logq, torch.tensor([adv]), torch.ones(1, len(w)), stale, cfg)
    loss.backward()
    return loss.item(), stats, logp.grad[0].tolist()


@pytest.mark.parametrize(
    ("kind", "w", "v", "clipped", "masked"),
    [
        ("tis", 3.0, 2.0, 1.0, 0.0),  # truncated at H = 2
        ("tis", 1.5, 1.5, 0.0, 0.0),
        ("mis", 3.0, 0.0, 0.0, 1.0),  # above H: masked
        ("mis", 0.25, 0.25, 0.0, 0.0),  # mis masks above only
        ("icepop", 0.25, 0.0, 0.0, 1.0),  # below L = 0.5: masked
        ("icepop", 0.75, 0.75, 0.0, 0.0),
        ("icepop", 3.0, 0.0, 0.0, 1.0),
    ],
)
def test_token_corrections_weight_each_token(kind, w, v, clipped, masked):
    cfg = ObjectiveConfig(correction=kind, correction_low=0.5, correction_high=2.0)
    loss, stats, grad = _corrected([w], 1.0, cfg)
    # rho = exp(logp - logold) = 1 in value, so loss = -v * A and d loss / d logp = -v * A
    assert loss == pytest.approx(-v, abs=1e-6)
    assert grad == pytest.approx([-v], abs=1e-6)
    assert stats["mismatch/0/clipped"] == clipped and stats["mismatch/0/masked"] == masked
    assert stats["mismatch/0/k3"] == pytest.approx(w - LN(w) - 1, abs=1e-6)


def test_sequence_corrections_use_the_product_of_the_tokens_weights():
    tis = ObjectiveConfig(correction="tis", correction_level="sequence", correction_high=4.0)
    loss, stats, grad = _corrected([2.0, 1.5], 1.0, tis)  # w = 3 <= 4: each token weighted 3, mean over 2 tokens
    assert loss == pytest.approx(-3.0, abs=1e-6) and grad == pytest.approx([-1.5, -1.5], abs=1e-6)
    assert stats["mismatch/0/units"] == 1.0 and stats["mismatch/0/clipped"] == 0.0
    mis = ObjectiveConfig(correction="mis", correction_level="sequence", correction_high=2.0)
    loss, stats, grad = _corrected([2.0, 1.5], 1.0, mis)  # w = 3 > 2: the whole sample is masked
    assert loss == 0.0 and grad == [0.0, 0.0] and stats["mismatch/0/masked"] == 2.0
    capped = ObjectiveConfig(correction="tis", correction_level="sequence", correction_high=2.0)
    loss, stats, _ = _corrected([2.0, 1.5], -1.0, capped)
    assert loss == pytest.approx(2.0, abs=1e-6) and stats["mismatch/0/clipped"] == 2.0


def test_none_keeps_the_ratio_against_the_behaviour():
    loss, stats, grad = _corrected([1.5], 1.0, ObjectiveConfig())  # rho = exp(0 - ln(1/1.5)) = 1.5, clipped at 1.28
    assert loss == pytest.approx(-1.28, abs=1e-6) and grad == [0.0]
    assert stats["mismatch/0/clipped"] == 0.0 and stats["mismatch/0/masked"] == 0.0
    _, stale, _ = _corrected([3.0], -1.0, ObjectiveConfig(max_staleness=1), staleness=[1])
    assert stale["mismatch/1/clipped"] == 1.0  # the ratio_cap bounded it: counted as clipped


def test_mismatch_summary_by_staleness_by_hand():
    cfg = ObjectiveConfig(correction="tis", correction_high=2.5, max_staleness=2)
    _, stats, _ = _corrected([2.0, 0.5, 1.0, 4.0], 1.0, cfg, staleness=[0, 0, 1, 1])
    rows = {r["staleness"]: r for r in mismatch_summary(stats, 2)}
    k3 = [2 - LN(2) - 1, 0.5 + LN(2) - 1, 0.0, 4 - LN(4) - 1]
    assert rows[0]["kl"] == pytest.approx((k3[0] + k3[1]) / 2) and rows[0]["tokens"] == 2
    assert rows[0]["ess"] == pytest.approx(2.5 ** 2 / (2 * (4 + 0.25)))  # (sum w)^2 / (n sum w^2)
    assert rows[1]["ess"] == pytest.approx(5.0 ** 2 / (2 * (1 + 16))) and rows[1]["clipped"] == 0.5
    assert 2 not in rows  # no token of staleness 2
    assert rows[-1]["kl"] == pytest.approx(sum(k3) / 4) and rows[-1]["tokens"] == 4
    assert rows[-1]["ess"] == pytest.approx(7.5 ** 2 / (4 * (4 + 0.25 + 1 + 16)))
    assert rows[-1]["clipped"] == 0.25 and rows[-1]["masked"] == 0.0


def test_tokens_outside_the_replayed_support_are_masked():
    cfg = ObjectiveConfig(correction="none")
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, stats = grpo_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), torch.tensor([0]), cfg,
                            outside=torch.tensor([[False, True]]))
    loss.backward()
    assert loss.item() == pytest.approx(-0.5) and logp.grad[0].tolist() == pytest.approx([-0.5, 0.0])
    assert stats["mismatch/0/masked"] == 1.0


def test_forged_logprobs_cannot_overflow_the_corrections():
    for kind in ("tis", "mis", "icepop"):
        logp = torch.zeros(1, 1, requires_grad=True)
        loss, stats = grpo_loss(logp, torch.tensor([[-1e4]]), torch.tensor([1.0]), torch.ones(1, 1),
                                torch.tensor([0]), ObjectiveConfig(correction=kind))
        loss.backward()
        assert math.isfinite(loss.item()) and math.isfinite(logp.grad.item())
        assert all(math.isfinite(v) for v in stats.values())


def test_every_eps_low_a_jobspec_accepts_builds_the_learners_objective():
    """GRPOConfig.eps_low accepted 1.0, which the objective refuses: the job was accepted and its learner died at
    start, relaunched, died again (review finding). The spec now refuses it with a 422 naming the field."""
    from echo2.protocol import JobSpec
    from pydantic import ValidationError

    from learner.trainer import objective_config

    base = {"name": "j", "base_model": "echo2:tiny", "task": {"name": "arithmetic"}}
    with pytest.raises(ValidationError, match="grpo.eps_low"):
        JobSpec.model_validate({**base, "grpo": {"eps_low": 1.0}})
    for eps in (0.0, 0.2, 0.999):
        assert objective_config(JobSpec.model_validate({**base, "grpo": {"eps_low": eps}})).eps_low == eps
