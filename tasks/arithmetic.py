"""`arithmetic`: synthetic "a+b=" problems, scored by the accuracy of the final answer.

The default (operands 0..4, "+", bare "3+4=" prompts) is the demo task: a random-init tiny model
(learner/tiny.py) learns it from scratch with GRPO in about a hundred steps on a 2-core CPU
(tests/learner/test_learns.py). The answer is extracted like every numeric task
(tasks/answers.py: "####", \\boxed{}, "answer is", else the last number); reward 1.0 when it
equals a op b, else 0.0. No partial credit.

Held out: a `held_out` share of the distinct problems (by a hash of "a op b", so the same problems for
every job with these settings) is never generated for training; `eval_prompts` draws only from them.
Held-out accuracy is then accuracy on problems the model never saw, not memorisation.

Unlike gsm8k, this task does not use math-verify (tasks/verify.py): its references are
integers and its prompts ask for nothing but the number, which our parser reads in full, so
math-verify could only change verdicts on LaTeX the task never asks for, at the cost of a round trip
to a worker process per sample in the demo's hot loop.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field, model_validator

from tasks.answers import extract_final_answer, numbers_equal
from tasks.base import TaskAdapter, TaskError, TaskParams, TaskPrompt, check_count
from tasks.registry import register

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
    held_out: float = Field(default=0.2, ge=0, lt=1, description="Share of the distinct problems kept for "
                            "held-out evaluation and never trained on (0: none).")

    @model_validator(mode="after")
    def _check(self) -> ArithmeticParams:
        if self.max_operand < self.min_operand:
            raise ValueError("max_operand must be >= min_operand")
        if len(set(self.ops)) != len(self.ops):
            raise ValueError("ops must not repeat")
        return self


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


Problem = tuple[int, str, int]
ENUMERATE_UP_TO = 200_000  # problem spaces this small are listed; larger ones are sampled
MAX_DRAWS_PER_PROMPT = 10_000  # a held-out share as small as 1e-4 still fills an eval set


def is_held_out(problem: Problem, share: float) -> bool:
    """Whether a problem belongs to the held-out split: a stable hash, so no job seed can move it."""
    a, op, b = problem
    digest = hashlib.blake2b(f"{a}{op}{b}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < share * 2**64


class ArithmeticTask(TaskAdapter):
    name = "arithmetic"
    description = "Synthetic integer arithmetic; reward 1 if the final answer is right."
    Params = ArithmeticParams
    needs_dataset = False

    def generate_prompts(self, params: TaskParams, seed: int, count: int) -> list[TaskPrompt]:
        """`count` training problems (repeats allowed), none of them held out."""
        p = self._params(params)
        check_count(count)
        rng = random.Random(seed)
        if self._space(p) <= ENUMERATE_UP_TO:
            pool = self._split(p, held=False)
            if not pool and count:
                raise TaskError(f"every one of the {self._space(p)} problems is held out: widen the operand "
                                "range or lower held_out")
            return [self.make_prompt(*rng.choice(pool), p) for _ in range(count)]
        draws = (x for x in self._draws(p, rng) if not is_held_out(x, p.held_out))
        return [self.make_prompt(*next(draws), p) for _ in range(count)]

    def eval_prompts(self, params: TaskParams, seed: int, count: int) -> list[TaskPrompt]:
        """Up to `count` distinct held-out problems, in an order drawn from `seed`."""
        p = self._params(params)
        check_count(count)
        rng = random.Random(seed)
        if self._space(p) <= ENUMERATE_UP_TO:
            pool = self._split(p, held=True)
            return [self.make_prompt(*x, p) for x in rng.sample(pool, min(count, len(pool)))]
        chosen: dict[Problem, None] = {}  # a large space: a bounded search finds the held-out share's
        for x in itertools.islice(self._draws(p, rng), MAX_DRAWS_PER_PROMPT * count):
            if len(chosen) == count:
                break
            if is_held_out(x, p.held_out):
                chosen.setdefault(x)
        return [self.make_prompt(*x, p) for x in chosen]

    def make_prompt(self, a: int, op: str, b: int, params: ArithmeticParams) -> TaskPrompt:
        expr = f"{a}{op}{b}"
        text = f"{expr}=" if params.style == "bare" else f"what is {expr}?\n"
        return TaskPrompt(text=text, reference=str(_apply(a, op, b)))

    def all_prompts(self, params: TaskParams, *, held: bool | None = None) -> list[TaskPrompt]:
        """Every distinct problem of a small setting, or only the training (held=False) or held-out ones."""
        p = self._params(params)
        problems = self._problems(p) if held is None else self._split(p, held=held)
        return [self.make_prompt(*x, p) for x in problems]

    def _params(self, params: TaskParams) -> ArithmeticParams:
        p = self.parse_params(params)
        assert isinstance(p, ArithmeticParams)
        return p

    @staticmethod
    def _space(p: ArithmeticParams) -> int:
        return len(p.ops) * (p.max_operand - p.min_operand + 1) ** 2

    @staticmethod
    def _problems(p: ArithmeticParams) -> list[Problem]:
        span = range(p.min_operand, p.max_operand + 1)
        return [(a, op, b) for op in p.ops for a in span for b in span]

    def _split(self, p: ArithmeticParams, *, held: bool) -> list[Problem]:
        return [x for x in self._problems(p) if is_held_out(x, p.held_out) is held]

    @staticmethod
    def _draws(p: ArithmeticParams, rng: random.Random) -> Iterator[Problem]:
        while True:
            a, op = rng.randint(p.min_operand, p.max_operand), rng.choice(p.ops)
            yield a, op, rng.randint(p.min_operand, p.max_operand)

    def reward(self, prompt: TaskPrompt, completion: str, params: TaskParams) -> float | None:
        return 1.0 if numbers_equal(extract_final_answer(completion), prompt.reference) else 0.0


register(ArithmeticTask())
