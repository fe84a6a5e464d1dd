"""`arithmetic`: synthetic "a+b=" problems, scored by the accuracy of the final answer.

The default (operands 0..4, "+", bare "3+4=" prompts) is the demo task: a random-init tiny model
(learner/tiny.py) learns it from scratch with GRPO in about a hundred steps on a 2-core CPU
(tests/learner/test_learns.py). The answer is extracted like every numeric task
(learner/tasks/answers.py: "####", \\boxed{}, "answer is", else the last number); reward 1.0 when it
equals a op b, else 0.0. No partial credit.

Unlike gsm8k, this task does not use math-verify (learner/tasks/verify.py): its references are
integers and its prompts ask for nothing but the number, which our parser reads in full, so
math-verify could only change verdicts on LaTeX the task never asks for, at the cost of a round trip
to a worker process per sample in the demo's hot loop.
"""

from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import Field, model_validator

from learner.tasks.answers import extract_final_answer, numbers_equal
from learner.tasks.base import TaskAdapter, TaskParams, TaskPrompt, check_count
from learner.tasks.registry import register

Op = Literal["+", "-", "*"]

# Found by tests/learner/test_learns.py on a 2-core CPU; the demo job's defaults.
DEMO_DEFAULTS: dict[str, Any] = {
    "task": "arithmetic",
    "task_params": {"min_operand": 0, "max_operand": 4, "ops": ["+"], "style": "bare"},
    "group_size": 8,
    "prompts_per_step": 64,
    "lr": 5e-4,
    "adam_betas": [0.9, 0.99],
    "weight_decay": 0.0,
    "grad_clip": 1.0,
    "max_new_tokens": 3,
    "temperature": 1.0,
    "eps_low": 0.2,
    "eps_high": 0.28,
    "ratio_cap": 2.0,
    "kl_coef": 0.0,
    "length_norm": "token_mean",
    "scale_by_std": True,
    "target_reward": 0.8,
    "max_steps": 300,
}


class ArithmeticParams(TaskParams):
    min_operand: int = Field(default=0, ge=0, le=1000)
    max_operand: int = Field(default=4, ge=0, le=1000)
    ops: list[Op] = Field(default_factory=lambda: ["+"], min_length=1, max_length=3)
    style: Literal["bare", "question"] = "bare"  # "3+4=" or "what is 3+4?\n"

    @model_validator(mode="after")
    def _check(self) -> ArithmeticParams:
        if self.max_operand < self.min_operand:
            raise ValueError("max_operand must be >= min_operand")
        if len(set(self.ops)) != len(self.ops):
            raise ValueError("ops must not repeat")
        return self


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


class ArithmeticTask(TaskAdapter):
    name = "arithmetic"
    description = "Synthetic integer arithmetic; reward 1 if the final answer is right."
    Params = ArithmeticParams
    needs_dataset = False

    def generate_prompts(self, params: TaskParams, seed: int, count: int) -> list[TaskPrompt]:
        p = self.parse_params(params)
        assert isinstance(p, ArithmeticParams)
        check_count(count)
        rng = random.Random(seed)
        prompts = []
        for _ in range(count):
            a = rng.randint(p.min_operand, p.max_operand)
            b = rng.randint(p.min_operand, p.max_operand)
            op = rng.choice(p.ops)
            prompts.append(self.make_prompt(a, op, b, p))
        return prompts

    def make_prompt(self, a: int, op: str, b: int, params: ArithmeticParams) -> TaskPrompt:
        expr = f"{a}{op}{b}"
        text = f"{expr}=" if params.style == "bare" else f"what is {expr}?\n"
        return TaskPrompt(text=text, reference=str(_apply(a, op, b)))

    def all_prompts(self, params: TaskParams) -> list[TaskPrompt]:
        """Every distinct problem (for exhaustive evaluation of small settings)."""
        p = self.parse_params(params)
        assert isinstance(p, ArithmeticParams)
        span = range(p.min_operand, p.max_operand + 1)
        return [self.make_prompt(a, op, b, p) for op in p.ops for a in span for b in span]

    def reward(self, prompt: TaskPrompt, completion: str, params: TaskParams) -> float | None:
        return 1.0 if numbers_equal(extract_final_answer(completion), prompt.reference) else 0.0


register(ArithmeticTask())
