"""The trainer's side of trust, on the real tiny model: groups that do not fit the model or fail the audit
the control plane asked for are refused with a reason and never trained; forged logprobs that pass
unaudited cannot make the step fail."""

from __future__ import annotations

import math

import pytest
import torch
from echo2.loading import load_causal_lm
from echo2.prompting import encode_prompt
from echo2.protocol import ClaimedGroup, JobSpec, SampleSubmit, TaskSpec

from learner.auditor import Auditor
from learner.parallel import Solo
from learner.policy import sample
from learner.trainer import GRPOTrainer
from tasks import TaskAdapter, register


@pytest.fixture
def trainer(tiny_dir):
    from transformers import AutoTokenizer

    spec = JobSpec.model_validate({"name": "t", "base_model": str(tiny_dir), "task": {"name": "arithmetic"},
                                   "grpo": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 6}})
    model = load_causal_lm(tiny_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    t = GRPOTrainer(model, tok, spec)
    t.auditor = Auditor(str(tiny_dir), spec, fetch=lambda v: pytest.fail("no fetch expected"))
    t.auditor.remember(0, Solo().model_state(model))
    return t


def group(trainer, i: int, audit: bool = False, forge=None) -> ClaimedGroup:
    text = f"What is {i} + {i}?"
    ids = encode_prompt(trainer.tokenizer, text)
    trainer.model.eval()
    out = sample(trainer.model, [ids] * 4, max_new_tokens=6, eos_id=trainer.tokenizer.eos_token_id,
                 pad_id=trainer.pad_id, seed=i)
    samples = [SampleSubmit(token_ids=s.completion_ids or [trainer.tokenizer.eos_token_id],
                            logprobs=s.logprobs or [0.0], finish_reason="stop" if s.finished else "length")
               for s in out]
    samples = [SampleSubmit(**forge(s.model_dump())) for s in samples] if forge else samples
    return ClaimedGroup(rollout_id=f"rol_{i}", prompt_id=i, prompt_text=text, reference=str(2 * i), version=0,
                        worker_id="wrk_1", prompt_token_ids=ids, samples=samples, audit=audit)


def test_misfits_and_failed_audits_are_refused_and_honest_audits_pass(trainer):
    vocab = trainer.model.get_input_embeddings().num_embeddings
    groups = [
        group(trainer, 1, audit=True),
        group(trainer, 2, audit=True, forge=lambda s: {**s, "logprobs": [-20.0] * len(s["token_ids"])}),
        group(trainer, 3, forge=lambda s: {**s, "token_ids": [vocab] * len(s["token_ids"])}),
        group(trainer, 4).model_copy(update={"prompt_token_ids": [1, 2, 3]}),
    ]
    result = trainer.step(groups, 0)
    assert set(result.rejected) == {"rol_2", "rol_3", "rol_4"}
    assert result.rejected["rol_2"].startswith("failed its audit: logprob mismatch")
    assert "outside the model's vocabulary" in result.rejected["rol_3"]
    assert "not the encoding of the leased prompt" in result.rejected["rol_4"]
    verdicts = {a.rollout_id: a.passed for a in result.audits}
    assert verdicts == {"rol_1": True, "rol_2": False} and result.audit_s > 0
    assert set(result.rewards) == {"rol_1"}


def test_spare_audits_judge_unpicked_groups_one_sender_at_a_time_and_the_step_refuses_what_failed(trainer):
    one_nat_low = lambda s: {**s, "logprobs": [lp - 1.0 for lp in s["logprobs"]]}  # noqa: E731
    groups = [group(trainer, 1).model_copy(update={"worker_id": "wrk_a"}),
              group(trainer, 2, forge=one_nat_low).model_copy(update={"worker_id": "wrk_a"}),
              group(trainer, 3, forge=one_nat_low).model_copy(update={"worker_id": "wrk_b"}),
              group(trainer, 4, audit=True)]
    assert trainer.audit_spare(groups, budget_s=0.0) == []  # no time: nothing judged
    judged = trainer.audit_spare(groups, budget_s=60.0)  # each sender's first, then wrk_a's second; not the picked
    assert [(a.rollout_id, a.passed) for a in judged] == [("rol_1", True), ("rol_3", False), ("rol_2", False)]
    assert trainer.audit_spare(groups, budget_s=60.0) == []  # judged once
    assert trainer.early_audit_s > 0

    result = trainer.step(groups, 0)  # the picked group is audited now; the others use their spare verdicts
    assert set(result.rejected) == {"rol_2", "rol_3"}
    assert result.rejected["rol_3"].startswith("failed its audit: logprob mismatch")
    assert {a.rollout_id: a.passed for a in result.audits} == {"rol_1": True, "rol_2": False, "rol_3": False,
                                                                "rol_4": True}
    assert set(result.rewards) == {"rol_1", "rol_4"}


def test_a_senders_failed_audit_has_its_other_held_groups_audited_before_they_train(trainer):
    """Groups claimed before their sender was struck were claimed unpicked: they trained unjudged beside the one
    that failed (a trusted worker forging every group had one in ten audited, the rest of the step trained)."""
    one_nat_low = lambda s: {**s, "logprobs": [lp - 1.0 for lp in s["logprobs"]]}  # noqa: E731
    groups = [group(trainer, 1, forge=one_nat_low).model_copy(update={"worker_id": "wrk_x"}),  # before the picked
              group(trainer, 2, audit=True, forge=one_nat_low).model_copy(update={"worker_id": "wrk_x"}),
              group(trainer, 3).model_copy(update={"worker_id": "wrk_x"}),
              group(trainer, 4, forge=one_nat_low).model_copy(update={"worker_id": "wrk_y"})]
    result = trainer.step(groups, 0)
    assert set(result.rejected) == {"rol_1", "rol_2"}
    assert {a.rollout_id: a.passed for a in result.audits} == {"rol_1": False, "rol_2": False, "rol_3": True}
    assert set(result.rewards) == {"rol_3", "rol_4"}  # another sender's unpicked group is not audited for it

    later = [group(trainer, 5, forge=one_nat_low).model_copy(update={"worker_id": "wrk_x"})]
    assert set(trainer.step(later, 1).rejected) == {"rol_5"}  # its groups held for later steps are audited too

    vocab = trainer.model.get_input_embeddings().num_embeddings
    misfit = [group(trainer, 6, forge=one_nat_low).model_copy(update={"worker_id": "wrk_z"}),
              group(trainer, 7, forge=lambda s: {**s, "token_ids": [vocab] * len(s["token_ids"])})
              .model_copy(update={"worker_id": "wrk_z"})]
    assert set(trainer.step(misfit, 2).rejected) == {"rol_6", "rol_7"}  # a misfit's sender counts as failed


def test_unaudited_forged_logprobs_leave_the_step_finite(trainer):
    """Finding 1: every logprob -1e4 and one sample spelling the answer (so the group carries a signal)."""
    tok = trainer.tokenizer
    forged = []
    for i in range(1, 5):
        honest = group(trainer, i)
        samples = [s.model_dump() for s in honest.samples]
        samples[0].update(token_ids=tok(str(2 * i))["input_ids"] + [tok.eos_token_id], finish_reason="stop")
        for s in samples:
            s["logprobs"] = [-1e4] * len(s["token_ids"])
        forged.append(honest.model_copy(update={"samples": [SampleSubmit(**s) for s in samples]}))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    result = trainer.step(forged, 0)
    assert not result.rejected and result.reward_mean == pytest.approx(0.25)  # one sample in four right
    assert math.isfinite(result.loss) and abs(result.loss) <= 10.0 + 1e-6  # ratios capped at FRESH_CAP
    after = list(trainer.model.parameters())
    # every token's ratio hit the cap, and capped tokens carry no gradient: the poison moves nothing
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_completion_no_task_can_score_is_dropped_and_the_step_goes_on(trainer, tiny_dir):
    """A worker's 400-digit answer (float() of it overflows) is scored exactly; a task that raises on some text
    leaves that group unscored and untrained (reported, so the control plane can pause a job whose task keeps
    failing), never the learner."""
    nine = trainer.tokenizer.convert_tokens_to_ids("9")
    long_answer = group(trainer, 1).model_copy(update={"samples": [
        SampleSubmit(token_ids=[nine] * 400, logprobs=[-1.0] * 400, finish_reason="length")] * 4})
    assert trainer.step([long_answer, group(trainer, 2)], 0).rewards["rol_1"] == [0.0] * 4

    class Picky(TaskAdapter):
        name = "test_picky"
        description = "Test task: cannot score a completion with a nine in it."

        def reward(self, prompt, completion, params):
            if "9" in completion:
                raise ValueError("cannot score a nine")
            return 0.5

    register(Picky())
    spec = trainer.spec.model_copy(update={"task": TaskSpec(name="test_picky")})
    picky = GRPOTrainer(trainer.model, trainer.tokenizer, spec)
    result = picky.step([long_answer, group(trainer, 3)], 1)
    assert "rol_1" not in result.rewards and "cannot score a nine" in result.unscored["rol_1"]
    assert result.rewards["rol_3"] == [0.5] * 4 and math.isfinite(result.loss)


def test_a_group_the_task_cannot_score_is_audited_before_it_is_paid_as_the_platforms_fault(trainer):
    """An unscored group is paid without blame (the endpoint's fault, not the sender's): junk that makes a strict
    reward endpoint fail was paid for no work. Every unscored group is audited first: junk fails and is refused
    (its sender struck), an honest group the task cannot score stays unscored with its passed audit."""
    class Strict(TaskAdapter):
        name = "test_strict_endpoint"

        def reward(self, prompt, completion, params):
            raise ValueError("the endpoint refused the completion")

    register(Strict())
    spec = trainer.spec.model_copy(update={"task": TaskSpec(name="test_strict_endpoint")})
    strict = GRPOTrainer(trainer.model, trainer.tokenizer, spec, auditor=trainer.auditor)
    nine = trainer.tokenizer.convert_tokens_to_ids("9")
    junk = group(trainer, 1).model_copy(update={"worker_id": "wrk_junk", "samples": [
        SampleSubmit(token_ids=[nine] * 6, logprobs=[-0.01] * 6, finish_reason="length")] * 4})
    honest = group(trainer, 2).model_copy(update={"worker_id": "wrk_honest"})
    result = strict.step([junk, honest], 0)
    assert result.rejected["rol_1"].startswith("failed its audit") and "rol_1" not in result.unscored
    assert "endpoint refused" in result.unscored["rol_2"]
    assert {a.rollout_id: a.passed for a in result.audits} == {"rol_1": False, "rol_2": True}
