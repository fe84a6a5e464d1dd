"""`exact_match` and `regex`: string verifiers over user JSONL items {"prompt": ..., "reference": ...}.

exact_match: 1.0 when the (optionally stripped / case-folded / whitespace-collapsed) completion equals
the reference. regex: 1.0 when the pattern matches the completion (`search` anywhere or `fullmatch`);
the pattern is either fixed in the params or taken per item from the reference key. Patterns run on RE2
(google-re2), in time linear in the text: the completion is a worker's, and with Python's backtracking
`re` a pattern such as `(a+)+$` and a crafted completion could stall the learner for hours. RE2 has no
backreferences or lookarounds; a pattern using them is refused when the job is created.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import re2
from pydantic import Field, field_validator

from tasks.base import TaskAdapter, TaskItemError, TaskParams, TaskPrompt, require_key
from tasks.registry import register


class _ItemKeys(TaskParams):
    prompt_key: str = Field(default="prompt", min_length=1, max_length=64)
    reference_key: str = Field(default="reference", min_length=1, max_length=64)
    strip: bool = True


class ExactMatchParams(_ItemKeys):
    case_sensitive: bool = True
    collapse_whitespace: bool = False


def _normalise(text: str, p: ExactMatchParams) -> str:
    if p.collapse_whitespace:
        text = " ".join(text.split())
    if p.strip:
        text = text.strip()
    if not p.case_sensitive:
        text = text.casefold()
    return text


class ExactMatchTask(TaskAdapter):
    name = "exact_match"
    description = "Reward 1 if the completion equals the item's reference string."
    Params = ExactMatchParams
    needs_dataset = True

    def prompt_from_item(self, item: Mapping[str, Any], params: TaskParams) -> TaskPrompt:
        p = self.parse_params(params)
        assert isinstance(p, ExactMatchParams)
        text = require_key(item, p.prompt_key, self.name)
        return TaskPrompt(text=text, reference=require_key(item, p.reference_key, self.name))

    def reward(self, prompt: TaskPrompt, completion: str, params: TaskParams) -> float | None:
        p = self.parse_params(params)
        assert isinstance(p, ExactMatchParams)
        if prompt.reference is None:
            return None
        return 1.0 if _normalise(completion, p) == _normalise(prompt.reference, p) else 0.0


class RegexParams(_ItemKeys):
    pattern: str | None = Field(default=None, min_length=1, max_length=2000)
    mode: Literal["search", "fullmatch"] = "search"
    ignore_case: bool = False

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str | None) -> str | None:
        if v is not None:
            problem = _problem(v)
            if problem:
                raise ValueError(f"not a valid regular expression: {problem}")
        return v


def _compiled(pattern: str, ignore_case: bool = False) -> Any:
    options = re2.Options()
    options.log_errors = False  # a refused pattern is the caller's error, not the process's stderr
    options.case_sensitive = not ignore_case
    return re2.compile(pattern, options)


def _problem(pattern: str) -> str | None:
    """Why RE2 refuses `pattern`, or None."""
    try:
        _compiled(pattern)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        return f"{reason} (Echo2 matches with RE2: no backreferences or lookarounds)"
    return None


class RegexTask(TaskAdapter):
    name = "regex"
    description = "Reward 1 if the completion matches a regular expression (fixed or per item)."
    Params = RegexParams
    needs_dataset = True

    def prompt_from_item(self, item: Mapping[str, Any], params: TaskParams) -> TaskPrompt:
        p = self.parse_params(params)
        assert isinstance(p, RegexParams)
        text = require_key(item, p.prompt_key, self.name)
        if p.pattern is not None:
            return TaskPrompt(text=text, reference=p.pattern)
        pattern = require_key(item, p.reference_key, self.name)
        problem = _problem(pattern)
        if problem:
            raise TaskItemError(f"task {self.name!r}: item {p.reference_key!r} is not a regex: {problem}")
        return TaskPrompt(text=text, reference=pattern)

    def reward(self, prompt: TaskPrompt, completion: str, params: TaskParams) -> float | None:
        p = self.parse_params(params)
        assert isinstance(p, RegexParams)
        pattern = p.pattern or prompt.reference
        if pattern is None:
            return None
        text = completion.strip() if p.strip else completion
        compiled = _compiled(pattern, p.ignore_case)
        match = compiled.fullmatch if p.mode == "fullmatch" else compiled.search
        return 1.0 if match(text) else 0.0


register(ExactMatchTask())
register(RegexTask())
