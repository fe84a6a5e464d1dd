"""learner/resume.py promises that a relaunched learner trains the committed steps again "as they were
trained", which "on the same kind of device gives the same weights bit for bit". With a LoRA job whose adapter
drops out (LoraConfig.dropout, a documented option), the dropout masks come from torch's global RNG; the dead
learner's auditor built its own model with a fresh LoRA adapter (Auditor._build -> with_adapter, whose init
draws from that same global RNG) before training, and the replaying learner, which audits nothing, does not.
So the replay trained on other dropout masks and ended on other weights than the version the dead learner
published and workers sample from (review finding). The auditor's adapter draws from a forked stream now."""

from __future__ import annotations

from pathlib import Path

import torch
from echo2.loading import load_causal_lm
from echo2.prompting import encode_prompt
from echo2.protocol import ClaimedGroup, JobSpec, SampleSubmit

from learner.auditor import Auditor
from learner.loop import LearnerOptions, build_trainer
from learner.parallel import Solo
from learner.policy import sample
from tasks import TaskAdapter, register


class _ByLength(TaskAdapter):
    """Rewards that differ within a group, so every group trains."""

    name = "test_resume_by_length"
    description = "Test task: a sample's reward is its length."

    def reward(self, prompt, completion, params):  # type: ignore[no-untyped-def]
        return float(len(completion))


register(_ByLength())

SPEC = {"name": "lora-dropout", "task": {"name": "test_resume_by_length"}, "staleness": 2,
        "grpo": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 6, "lr": 1e-2},
        "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.5, "target_modules": ["q_proj", "v_proj"]}}


def _groups(tiny_dir: Path, tok, first: int, audit: bool) -> list[ClaimedGroup]:  # type: ignore[no-untyped-def]
    """Honest groups of version 0 (the base: the adapter starts at zero), sampled by a model of their own."""
    base = load_causal_lm(tiny_dir, dtype=torch.float32).eval()
    out = []
    for i in range(first, first + 2):
        text = f"{i}+{i}="
        ids = encode_prompt(tok, text)
        drawn = sample(base, [ids] * 4, max_new_tokens=6, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, seed=i)
        samples = [SampleSubmit(token_ids=s.completion_ids, logprobs=s.logprobs,
                                finish_reason="stop" if s.finished else "length") for s in drawn]
        out.append(ClaimedGroup(rollout_id=f"rol_{i}", prompt_id=i, prompt_text=text, reference=str(2 * i),
                                version=0, worker_id="wrk_1", prompt_token_ids=ids, samples=samples, audit=audit))
    return out


def _learner(tiny_dir: Path, spec: JobSpec, work: Path):  # type: ignore[no-untyped-def]
    """As Learner._start_and_train builds it: the trainer (no checkpoint yet), then its auditor."""
    trainer, restored = build_trainer(spec, str(tiny_dir), LearnerOptions(work_dir=work), Solo(), work / "ckpt")
    assert restored is None
    trainer.auditor = Auditor(str(tiny_dir), spec, fetch=lambda v: (_ for _ in ()).throw(AssertionError(v)))
    trainer.auditor.remember(0, trainer.weights.snapshot())  # Learner._snapshot of version 0
    return trainer


def _adapter(trainer) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_a_replayed_lora_dropout_job_ends_on_the_weights_the_dead_learner_trained(tiny_dir: Path, tmp_path: Path):
    spec = JobSpec.model_validate({**SPEC, "base_model": str(tiny_dir)})

    # The first learner: step 0's groups are picked for an audit (a new worker is on probation), step 1's not.
    first = _learner(tiny_dir, spec, tmp_path / "host-a")
    steps = [_groups(tiny_dir, first.tokenizer, 1, audit=True), _groups(tiny_dir, first.tokenizer, 5, audit=False)]
    committed = []
    for t, groups in enumerate(steps):
        result = first.step(groups, t)
        assert not result.rejected and not result.unscored and result.groups_dropped == 0
        assert all(a.passed for a in result.audits)
        committed.append(([g for g in groups if g.rollout_id in result.rewards], result.rewards))
    published = _adapter(first)  # what the dead learner published as version 2

    # Killed before its first checkpoint; the relaunched learner replays the two committed steps (resume.replay).
    second = _learner(tiny_dir, spec, tmp_path / "host-b")
    for t, (groups, rewards) in enumerate(committed):
        second.replay(groups, rewards, t)
    replayed = _adapter(second)

    assert replayed.keys() == published.keys()
    differ = [n for n in published if not torch.equal(published[n], replayed[n])]
    assert not differ, f"{len(differ)} of {len(published)} adapter tensors differ after the replay, e.g. {differ[0]}"
