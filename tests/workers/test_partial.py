"""Partial rollouts in the real worker loop against the real control plane: a version published while a
generation runs is loaded between two of its segments, the generation goes on from the tokens it has,
and each token is tagged with (and its logprob computed under) the version that drew it."""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from echo2.loading import load_causal_lm
from echo2_worker.backends.transformers_backend import TransformersBackend
from sqlalchemy import select

from api.models import Rollout
from learner.audit import GroupClaim, audit_group, audit_versions
from learner.tiny import build_long_tail_model
from tests.conftest import Api
from tests.factories import publish

from .conftest import start_job, wait_for

MAX_NEW = 64  # four segments of 16 tokens (partial.segment_tokens)


class GatedBackend(TransformersBackend):
    """The real backend, held at two points so a version is sure to arrive mid-generation whatever the
    machine's speed: the first segment returns once the worker has been told of version 1 (so the next
    segment's refresh starts its download), the second once version 1 is on disk (so the third runs on it)."""

    gates: list[threading.Event] = []

    def __init__(self) -> None:
        super().__init__(device="cpu")
        self.calls = 0

    def generate(self, requests):  # type: ignore[no-untyped-def]
        out = super().generate(requests)
        if self.calls < len(self.gates):
            assert self.gates[self.calls].wait(120), f"gate {self.calls} never opened"
        self.calls += 1
        return out


def spanning(api: Api, job_id: str) -> list[Rollout]:
    with api.db.session() as s:
        rows = s.scalars(select(Rollout).where(Rollout.job_id == job_id)).all()
        return [r for r in rows if any(len(x.get("versions") or []) > 1 for x in r.samples)]


def test_a_generation_continues_on_the_version_published_while_it_ran(api: Api, tiny_model_dir: Path,
                                                                    next_model_dir: Path, worker_factory) -> None:
    setup = start_job(api, tiny_model_dir, partial_rollouts=True,
                      grpo={"group_size": 2, "prompts_per_step": 256, "max_new_tokens": MAX_NEW})
    GatedBackend.gates = [threading.Event(), threading.Event()]
    w = worker_factory(setup, backend_factory=GatedBackend, gen_batch_prompts=4)
    wait_for(lambda: w.worker.leases.active(), 120, "a lease being generated")
    publish(setup.learner, setup.id, next_model_dir, version=1, step=0)
    wait_for(lambda: (a := w.worker.heartbeats.assignment()) and a.version == 1, 60, "the news of v1")
    GatedBackend.gates[0].set()
    wait_for(lambda: w.store.loadable(setup.id, 1), 120, "version 1 on disk")
    GatedBackend.gates[1].set()
    row = wait_for(lambda: spanning(api, setup.id), 120, "a sample with tokens of two versions")[0]
    assert row.status == "accepted" and row.version == 0  # the group's version: its oldest token's
    mixed = next(x for x in row.samples if len(x.get("versions") or []) > 1)
    assert [v for v, _ in mixed["versions"]] == [0, 1] and sum(n for _, n in mixed["versions"]) == len(
        mixed["token_ids"])

    # Each token's logprob is its own version's, and each token replays under its own version from the group's
    # leased seed: re-scored and replayed per version they all match; under version 0 alone the version-1
    # tokens do not. (Whether they are off by more than the audit's tolerance depends on how many tokens came
    # after the swap, which timing decides, so the test compares the differences themselves.)
    models = {v: load_causal_lm(d, dtype=torch.float32).eval()
              for v, d in ((0, tiny_model_dir), (1, next_model_dir))}
    claim = GroupClaim(prompt=row.prompt_token_ids, samples=[(x["token_ids"], x["logprobs"]) for x in row.samples],
                       temperature=1.0, seed=row.seed)
    versions = [[v for v, n in (x.get("versions") or [[row.version, len(x["token_ids"])]]) for _ in range(n)]
                for x in row.samples]
    per_version = audit_versions(models.__getitem__, claim, versions)
    assert per_version.passed and per_version.max_abs_diff < 1e-3, per_version
    assert per_version.replayed == per_version.tokens and per_version.mismatches == 0
    alone = audit_group(models[0], claim)
    assert alone.max_abs_diff > 100 * max(per_version.max_abs_diff, 1e-4), alone
    assert w.worker.versions.loaded == (setup.id, 1)
    assert w.drain() == 0


def test_a_short_group_leaves_while_a_long_one_of_its_batch_still_generates(api: Api, tiny_model_dir: Path,
                                                                           tmp_path: Path, worker_factory) -> None:
    """Groups are submitted as they finish: three short groups batched with a long one are accepted while the
    long one is held at its second segment (without partial rollouts they would wait for it, and age)."""
    model = build_long_tail_model(tiny_model_dir, tmp_path / "long-tail", p_stop_short=0.5, p_stop_long=1e-6)
    items = [{"prompt": "what is 1+2 #", "reference": "0"}] + [{"prompt": f"what is {i}+2?", "reference": "0"}
                                                                for i in range(3)]
    setup = start_job(api, model, partial_rollouts=True, task={"name": "exact_match"}, num_prompts=None,
                      prompts=[{"item": i} for i in items],
                      grpo={"group_size": 2, "prompts_per_step": 4, "max_new_tokens": MAX_NEW})
    GatedBackend.gates = [threading.Event(), threading.Event()]
    GatedBackend.gates[0].set()  # the first segment returns at once; the second (the long group's) is held
    w = worker_factory(setup, backend_factory=GatedBackend, gen_batch_prompts=4)
    short = wait_for(lambda: len(rows := groups(api, setup.id)) >= 3 and rows, 120, "the three short groups")
    assert len(short) == 3 and all(r.status == "accepted" for r in short)
    assert all(len(x["token_ids"]) < MAX_NEW // 4 for r in short for x in r.samples)
    GatedBackend.gates[1].set()
    rows = wait_for(lambda: len(rows := groups(api, setup.id)) == 4 and rows, 120, "the long group")
    [long] = [r for r in rows if r.id not in {r.id for r in short}]
    assert max(len(x["token_ids"]) for x in long.samples) > MAX_NEW // 4 and long.status == "accepted"
    assert w.drain() == 0


def groups(api: Api, job_id: str) -> list[Rollout]:
    with api.db.session() as s:
        return list(s.scalars(select(Rollout).where(Rollout.job_id == job_id)).all())
