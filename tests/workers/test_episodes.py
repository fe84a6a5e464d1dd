"""The worker plays multi-turn episodes with the control plane (echo2_worker/episodes.py) and submits
them as the platform saw them: accepted, scored by the platform's environment, the secret kept there."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select

from api.models import Episode, Prompt, Rollout
from tasks.answers import extract_final_answer, parse_number
from tests.conftest import Api

from .conftest import rollouts, start_job, wait_for

GUESS = {"name": "guess_number", "params": {"low": 1, "high": 6, "max_turns": 3}}


def test_a_worker_plays_each_sample_as_an_episode(api: Api, tiny_model_dir: Path, worker_factory) -> None:
    setup = start_job(api, tiny_model_dir, task=GUESS, num_prompts=8,
                      grpo={"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 3})
    worker_factory(setup)
    accepted = wait_for(lambda: rollouts(api, setup.id, "accepted"), 120, "accepted episodes")
    with api.db.session() as s:
        row = s.get(Rollout, accepted[0]["id"])
        played = {e.sample: e for e in s.scalars(select(Episode).where(Episode.lease_id == row.lease_id,
                                                                       Episode.prompt_id == row.prompt_id))}
        secret = s.get(Prompt, row.prompt_id).reference
        for k, sample in enumerate(row.samples):
            episode = played[k]
            assert episode.done and sample["turns"] == [len(t) for t in episode.turns]
            assert sample["token_ids"] == [i for t in episode.turns for i in t]
            found = any(parse_number(extract_final_answer(a)) == int(secret) for a in episode.actions)
            assert episode.reward == (1.0 if found else 0.0)
            assert len(episode.actions) == 3 or episode.reward == 1.0  # it went on until found or out of turns
        assert row.rewards == [played[k].reward for k in range(2)]
