"""`gsm8k`: math word problems from user JSONL items {"question": ..., "answer": ...}.

The item's answer may be a bare number or a GSM8K solution ending in "#### 42"; the reference is its
final answer. A completion scores 1.0 when its final answer equals the reference, else 0.0
(tasks/verify.py, `numeric_answer_equal`): the final answer is located as in
tasks/answers.py ("####", else the last \\boxed{}, else the text); a plain number there is
compared by our parser (commas, decimals, fractions, signs, $ and % tolerated; `rel_tol` applies to
it), anything else (\\frac{3}{4}, 1{,}200, words around the number) by math-verify, and by our parser
when math-verify finds no answer in it or runs out of time (2 s, in a worker process).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, field_validator

from tasks.answers import extract_final_answer, parse_number
from tasks.base import TaskAdapter, TaskItemError, TaskParams, TaskPrompt, require_key
from tasks.registry import register
from tasks.verify import numeric_answer_equal

DEFAULT_TEMPLATE = "Question: {question}\nThink step by step, then end with \"#### <number>\".\nAnswer:"


class Gsm8kParams(TaskParams):
    question_key: str = Field(default="question", min_length=1, max_length=64)
    answer_key: str = Field(default="answer", min_length=1, max_length=64)
    template: str = Field(default=DEFAULT_TEMPLATE, min_length=1, max_length=4000)
    rel_tol: float = Field(default=1e-6, ge=0.0, le=0.1)

    @field_validator("template")
    @classmethod
    def _has_question(cls, v: str) -> str:
        if "{question}" not in v:
            raise ValueError("template must contain the placeholder {question}")
        try:
            v.format(question="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"template may only use the placeholder {{question}} ({exc})") from None
        return v


class Gsm8kTask(TaskAdapter):
    name = "gsm8k"
    description = "Math word problems (JSONL question/answer); reward 1 if the final number matches."
    Params = Gsm8kParams
    needs_dataset = True

    def prompt_from_item(self, item: Mapping[str, Any], params: TaskParams) -> TaskPrompt:
        p = self.parse_params(params)
        assert isinstance(p, Gsm8kParams)
        question = require_key(item, p.question_key, self.name)
        answer = require_key(item, p.answer_key, self.name)
        reference = extract_final_answer(answer)
        if parse_number(reference) is None:
            raise TaskItemError(
                f"task {self.name!r}: item key {p.answer_key!r} has no numeric final answer: {answer[:80]!r}"
            )
        return TaskPrompt(text=p.template.format(question=question.strip()), reference=reference)

    def reward(self, prompt: TaskPrompt, completion: str, params: TaskParams) -> float | None:
        p = self.parse_params(params)
        assert isinstance(p, Gsm8kParams)
        if prompt.reference is None:
            return 0.0  # as before: nothing equals a missing reference
        return 1.0 if numeric_answer_equal(completion, prompt.reference, rel_tol=p.rel_tol) else 0.0


register(Gsm8kTask())
