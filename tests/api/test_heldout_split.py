"""Api/services/evals.py promises held-out prompts "a job never trains on", and the learner's
evaluation (learner/evaluate.py) reports its accuracy as held-out. split_items holds out item POSITIONS: a
dataset that repeats a prompt (common in scraped math sets, or a user's inline prompts) puts one copy in the
held-out set and trains on the other, so the "held-out" accuracy is measured on prompts the job trained on."""

from __future__ import annotations

from echo2.protocol import JobSpec

from api.services.evals import split_items


def test_no_held_out_prompt_is_also_a_training_prompt():
    spec = JobSpec.model_validate({"name": "t", "base_model": "echo2:tiny", "task": {"name": "exact_match"},
                                   "eval": {"fraction": 0.5, "size": 64}, "seed": 0})
    items = [(f"what is {i} + {i}?", str(2 * i), None) for i in range(20)] * 2  # every prompt twice
    train, held = split_items(items, spec)
    leaked = {text for text, _, _ in held} & {text for text, _, _ in train}
    assert not leaked, f"{len(leaked)} of {len(held)} held-out prompts are also trained on, e.g. {sorted(leaked)[:2]}"
