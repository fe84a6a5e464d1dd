"""Objective.py step 2b defines logold as "the learner's logprob before the step, on the weights it
publishes", and the mismatch statistics compare it with the behaviour logprob. grpo_update computes it in
`model.train()`, so with a LoRA job's `lora.dropout` > 0 (a documented JobSpec option) every logold carries
a random dropout mask: an honest, fresh sample drawn by the very weights being trained is reported as
off-policy (mismatch KL > 0), its tis/mis/icepop weights are random, and mis/icepop mask tokens at random."""

from __future__ import annotations

import torch
from echo2.loading import load_causal_lm
from echo2.protocol import LoraConfig

from learner.models import with_adapter
from learner.objective import ObjectiveConfig
from learner.policy import Rollouts, completion_logprobs, grpo_update, pad_batch


def test_a_fresh_sample_of_the_trained_weights_shows_no_mismatch_with_lora_dropout(tiny_dir):
    torch.manual_seed(0)
    model = with_adapter(load_causal_lm(tiny_dir, dtype=torch.float32), LoraConfig(rank=8, alpha=16, dropout=0.5))
    with torch.no_grad():  # an adapter that has trained a while: B no longer zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    prompts = [[1, 2, 3, 4]] * 4
    completions = [[5 + i, 6, 7 + i, 8, 9, 10] for i in range(4)]
    model.eval()
    with torch.no_grad():  # the behaviour logprobs: the same weights, as a worker (or the learner's sampler) runs them
        behaviour = completion_logprobs(model, pad_batch(prompts, completions, 0))
    rows = Rollouts()
    for i, reward in enumerate([1.0, 0.0, 1.0, 0.0]):
        rows.add(prompts[i], completions[i], behaviour[i].tolist(), reward, 0, 0)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    stats = grpo_update(model, opt, rows, ObjectiveConfig(correction="mis", correction_high=1.05), pad_id=0)
    total = stats["mismatch"][-1]
    assert total["kl"] < 1e-6 and total["masked"] == 0.0, (
        f"a fresh on-policy sample: mismatch kl {total['kl']:.2e}, ess {total['ess']:.4f}, "
        f"masked {total['masked']:.0%}")


def test_attention_dropout_set_in_the_config_is_off_for_logold(tiny_dir):
    """Llama-style attention applies its config's attention_dropout functionally, with no Dropout module to see."""
    torch.manual_seed(0)
    model = load_causal_lm(tiny_dir, dtype=torch.float32)
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    prompts = [[1, 2, 3, 4]] * 4
    completions = [[5 + i, 6, 7 + i, 8, 9, 10] for i in range(4)]
    model.eval()
    with torch.no_grad():
        behaviour = completion_logprobs(model, pad_batch(prompts, completions, 0))
    rows = Rollouts()
    for i, reward in enumerate([1.0, 0.0, 1.0, 0.0]):
        rows.add(prompts[i], completions[i], behaviour[i].tolist(), reward, 0, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    stats = grpo_update(model, opt, rows, ObjectiveConfig(correction="mis", correction_high=1.05), pad_id=0)
    assert stats["mismatch"][-1]["kl"] < 1e-6 and stats["mismatch"][-1]["masked"] == 0.0
