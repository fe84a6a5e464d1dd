"""A version written from a snapshot leaves the snapshot whole: the learner hands the same dict to the auditor,
and transformers 5's save_pretrained(state_dict=...) empties the dict it is given for a model built in code
(not for one loaded with from_pretrained, which is what the learner loads today)."""

from __future__ import annotations

import torch
from echo2.loading import load_causal_lm
from transformers import AutoTokenizer, Qwen2ForCausalLM

from learner.weights import Role, Weights


def test_writing_a_version_keeps_the_snapshot_it_was_given(tiny_model_dir, tmp_path):
    config = load_causal_lm(tiny_model_dir).config
    model = Qwen2ForCausalLM(config)  # built in code, as a test or a future learner path would
    weights = Weights(model, AutoTokenizer.from_pretrained(tiny_model_dir), torch.float32)
    state = weights.snapshot()
    keys = sorted(state)
    weights.write(state, tmp_path / "v1", Role.next)
    assert sorted(state) == keys  # what the auditor remembers is still every tensor
    written = load_causal_lm(tmp_path / "v1")
    assert torch.equal(written.model.norm.weight, state["model.norm.weight"])
