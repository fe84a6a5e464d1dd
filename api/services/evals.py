"""Held-out evaluation: which prompts a job never trains on, and the accuracy the learner reports on them.

Held-out prompts are chosen when the job is created and stored as prompts in state "eval", which the pool
never leases (pool.py takes "available" prompts only), so no worker generates for them and the learner
never trains on them. A synthetic task supplies them itself, disjoint from its training problems by
construction (TaskAdapter.eval_prompts); a dataset or inline prompts give up `eval.fraction` of their
distinct prompts (at most `eval.size`, chosen by the job's seed; every copy of a repeated prompt goes), or none
when that is less than one.

The learner evaluates (learner/evaluate.py): on the trusted side, on exactly the weights of a version,
with references workers never see.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

from echo2.protocol import EvalPrompt, EvalRead, EvalReport, JobSpec, PromptState
from sqlalchemy import select
from sqlalchemy.orm import Session

from ..errors import ApiError
from ..models import EvalResult, Job, Prompt

Item = tuple[str, str | None, Any]  # a prompt's text, reference and chat context


def split_items(items: list[Item], spec: JobSpec) -> tuple[list[Item], list[Item]]:
    """(training items, held-out items) of a dataset or inline prompts, items (text, reference, context). Distinct
    prompts are held out, not item positions: a prompt the items repeat is held out whole (evaluated once) or not at
    all, else "held-out" accuracy would be measured on a prompt the job trains on."""
    first: dict[str, Item] = {}  # each distinct prompt (text and chat context): its first item
    for item in items:
        first.setdefault(_prompt_key(item), item)
    held = min(spec.eval.size, math.floor(spec.eval.fraction * len(first)))
    if held < 1:
        return items, []
    order = list(first)
    random.Random(spec.seed).shuffle(order)
    out = set(order[:held])
    return [x for x in items if _prompt_key(x) not in out], [x for k, x in first.items() if k in out]


def _prompt_key(item: Item) -> str:
    text, _, context = item
    return json.dumps([text, context], sort_keys=True)


def prompts(db: Session, job_id: str) -> list[EvalPrompt]:
    rows = db.scalars(select(Prompt).where(Prompt.job_id == job_id, Prompt.state == PromptState.eval)
                      .order_by(Prompt.index))
    return [EvalPrompt(id=p.id, text=p.text, context=p.context, reference=p.reference) for p in rows]


def record(db: Session, job: Job, report: EvalReport) -> EvalRead:
    if report.step > job.step:
        raise ApiError(422, f"step {report.step} is not committed (the job is at step {job.step})", field="step")
    row = db.get(EvalResult, (job.id, report.step))
    if row is None:
        row = EvalResult(job_id=job.id, step=report.step)
        db.add(row)
    for key, value in report.model_dump().items():
        setattr(row, key, value)
    db.flush()
    return EvalRead.model_validate(row)


def reads(db: Session, job_id: str) -> list[EvalRead]:
    rows = db.scalars(select(EvalResult).where(EvalResult.job_id == job_id).order_by(EvalResult.step))
    return [EvalRead.model_validate(r) for r in rows]
