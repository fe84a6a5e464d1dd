"""Partial rollouts in the learner, on the real tiny model: a sample begun on version 0 and finished on
version 1 is trained with each token's ratio against its own behaviour logprob (capped as stale only
where the token is), and audited token by token under the version that produced it."""

from __future__ import annotations

import pytest
import torch
from echo2.loading import load_causal_lm
from echo2.prompting import encode_prompt
from echo2.protocol import ClaimedGroup, JobSpec, SampleSubmit

from learner.auditor import Auditor
from learner.objective import ObjectiveConfig, grpo_loss
from learner.parallel import Solo
from learner.policy import completion_logprobs, pad_batch, sample
from learner.trainer import GRPOTrainer, sample_staleness

HALF = 4  # tokens drawn by each version


def test_the_staleness_cap_applies_per_token():
    cfg = ObjectiveConfig(ratio_cap=2.0, eps_high=10.0)
    logprobs = torch.zeros(1, 4, requires_grad=True)
    behaviour = torch.full((1, 4), -1.0)  # every ratio e^1 = 2.7: above ratio_cap, below the fresh cap
    staleness = torch.tensor([[1, 1, 0, 0]])  # the first two tokens from an older version
    loss, stats = grpo_loss(logprobs, behaviour, torch.ones(1), torch.ones(1, 4), staleness, cfg)
    loss.backward()
    assert stats["cap_frac"] == 0.5
    assert logprobs.grad[0, :2].abs().sum() == 0 and (logprobs.grad[0, 2:] != 0).all()  # capped: no gradient
    _, whole = grpo_loss(logprobs, behaviour, torch.ones(1), torch.ones(1, 4), torch.tensor([1]), cfg)
    assert whole["cap_frac"] == 1.0  # one staleness for the whole sample would cap all four tokens


@pytest.fixture
def two_versions(tiny_dir):

    v0 = load_causal_lm(tiny_dir, dtype=torch.float32).eval()
    v1 = load_causal_lm(tiny_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in v1.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return v0, v1


def partial_group(tok, v0, v1, text: str, audit: bool) -> ClaimedGroup:
    """Four samples of `text`: HALF tokens drawn by v0, then HALF more by v1 from the tokens so far."""
    ids = encode_prompt(tok, text)
    pad, eos = tok.pad_token_id, tok.eos_token_id
    first = sample(v0, [ids] * 4, max_new_tokens=HALF, eos_id=-1, pad_id=pad,
                   seed=2)
    rest = sample(v1, [ids + s.completion_ids for s in first], max_new_tokens=HALF, eos_id=-1, pad_id=pad,
                  seed=3)
    samples = [SampleSubmit(token_ids=a.completion_ids + b.completion_ids, logprobs=a.logprobs + b.logprobs,
                            finish_reason="length", versions=[(0, HALF), (1, HALF)])
               for a, b in zip(first, rest, strict=True)]
    assert eos not in samples[0].token_ids
    return ClaimedGroup(rollout_id="rol_p", prompt_id=1, prompt_text=text, reference="4", version=0,
                        worker_id="wrk_1", prompt_token_ids=ids, samples=samples, audit=audit)


def test_each_token_is_weighed_against_its_own_versions_logprob(tiny_dir, two_versions):
    from transformers import AutoTokenizer

    v0, v1 = two_versions
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    g = partial_group(tok, v0, v1, "What is 2 + 2?", audit=False)
    s = g.samples[0]
    assert sample_staleness(s, g.version, 1) == [1] * HALF + [0] * HALF  # at step 1, v1 is the current policy
    batch = pad_batch([g.prompt_token_ids], [s.token_ids], tok.pad_token_id)
    with torch.no_grad():
        log_ratio = completion_logprobs(v1, batch)[0] - torch.tensor(s.logprobs)
    assert log_ratio[HALF:].abs().max() < 1e-4  # v1's own tokens: ratio 1 against their own behaviour logprob
    assert log_ratio[:HALF].abs().max() > 0.05  # v0's tokens: off-policy, weighed (and capped) as stale


def test_an_honest_partial_rollout_passes_its_audit_and_trains_a_forged_one_fails(tiny_dir, two_versions):
    from transformers import AutoTokenizer

    v0, v1 = two_versions
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    spec = JobSpec.model_validate({"name": "p", "base_model": str(tiny_dir), "task": {"name": "arithmetic"},
                                   "partial_rollouts": True, "staleness": 1,
                                   "grpo": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 2 * HALF}})
    trainer = GRPOTrainer(v1, tok, spec)  # the learner at step 1 holds version 1
    trainer.auditor = Auditor(str(tiny_dir), spec, fetch=lambda v: pytest.fail("no fetch expected"))
    trainer.auditor.remember(0, Solo().model_state(v0))
    trainer.auditor.remember(1, Solo().model_state(v1))
    honest = partial_group(tok, v0, v1, "What is 2 + 2?", audit=True)
    forged = partial_group(tok, v0, v1, "What is 3 + 1?", audit=True)  # v1's tokens claimed as v0's
    forged = forged.model_copy(update={"rollout_id": "rol_f", "samples": [
        s.model_copy(update={"versions": None}) for s in forged.samples]})
    result = trainer.step([honest, forged], 1)
    verdicts = {a.rollout_id: a for a in result.audits}
    assert verdicts["rol_p"].passed, verdicts["rol_p"].reason
    assert not verdicts["rol_f"].passed and "logprob mismatch" in (verdicts["rol_f"].reason or "")
    assert set(result.rejected) == {"rol_f"} and "rol_p" in result.rewards
    assert result.staleness_hist == [0, 1]  # counted by its oldest token


def test_a_partial_rollout_with_a_shadow_for_some_of_its_versions_is_judged_by_the_table(tiny_dir, two_versions):
    """The Tinker host shadows each checkpoint and goes without where memory runs out, so one version of a partial
    rollout may have a shadow and another none: the audit then measured part of the group's rounding, and judges
    it by the precision table, as without any shadow (it raised on the shadowed tokens' count before)."""
    import copy

    from transformers import AutoTokenizer

    from learner.audit import audit_versions
    from learner.auditor import claim_of

    v0, v1 = two_versions
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    spec = JobSpec.model_validate({"name": "p", "base_model": str(tiny_dir), "task": {"name": "arithmetic"},
                                   "partial_rollouts": True, "staleness": 1,
                                   "grpo": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 2 * HALF}})
    group = partial_group(tok, v0, v1, "What is 2 + 2?", audit=True)
    versions = [s.token_versions(group.version) for s in group.samples]
    shadows = {0: copy.deepcopy(v0).to(torch.bfloat16), 1: None}
    mixed = audit_versions({0: v0, 1: v1}.__getitem__, claim_of(group, spec), versions, None, shadows.__getitem__)
    both = audit_versions({0: v0, 1: v1}.__getitem__, claim_of(group, spec), versions, None,
                          {0: shadows[0], 1: copy.deepcopy(v1).to(torch.bfloat16)}.__getitem__)
    assert mixed.passed and mixed.rounding is None, mixed.reason
    assert both.passed and both.rounding is not None and both.rounding > 0, both.reason
