"""An honest worker running the shipped transformers backend, unmodified, on a job at
a temperature the spec allows (0.05, its minimum) fails the learner's audit on the likelihood z-test, in about
1-2 % of its groups where the model is confident: one honest draw of a token of probability ~1e-3 in a group of
near-certain tokens gives z = (log q - m)/sqrt(sum v) far below -6 (the test's normal approximation does not
hold for a sum of a few very skewed terms). Each failure is a strike; two quarantine the worker."""

from __future__ import annotations

import pytest
import torch
from echo2.loading import load_causal_lm
from echo2.protocol import ClaimedGroup, JobSpec, SampleSubmit
from echo2.seeds import sample_seed
from echo2_worker.backends import GenRequest, create_backend

from learner.auditor import Auditor

T = 0.05  # GRPOConfig.temperature's lower bound
GROUPS = 300


@pytest.fixture(scope="module")
def tok(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


def _auditor(tiny_dir, group_size: int, max_new: int) -> Auditor:
    spec = JobSpec.model_validate({"name": "t", "base_model": str(tiny_dir), "task": {"name": "arithmetic"},
                                   "grpo": {"group_size": group_size, "max_new_tokens": max_new, "temperature": T}})
    auditor = Auditor(str(tiny_dir), spec, fetch=lambda v: pytest.fail("no fetch expected"))
    model = load_causal_lm(tiny_dir, dtype=torch.float32).eval()
    auditor.remember(0, {k: v.clone() for k, v in model.state_dict().items()})
    return auditor


def test_honest_low_temperature_groups_pass_the_audit(tiny_dir, tok):
    group_size = 8  # 4 of 300 honest groups failed (at G = 2, 1 of 300)
    # A prompt on which the tiny model at T = 0.05 puts 0.999 on one next token (a real model is that sure on
    # most tokens of a formatted answer); one-token completions (max_new_tokens = 1, an allowed setting).
    prompt = tok("7+0=")["input_ids"]
    backend = create_backend("transformers", device="cpu")
    backend.load(tiny_dir)
    requests = [GenRequest(prompt_token_ids=prompt, n=group_size, max_new_tokens=1, temperature=T,
                           seeds=[sample_seed(seed, k) for k in range(group_size)]) for seed in range(GROUPS)]
    groups = backend.generate(requests)  # the worker's own generation, as its poll loop calls it
    backend.close()
    auditor = _auditor(tiny_dir, group_size, 1)
    failed = []
    for seed, samples in enumerate(groups):
        claimed = ClaimedGroup(rollout_id=f"rol_{seed}", prompt_id=0, prompt_text="7+0=", reference=None, version=0,
                               worker_id="wrk_honest", prompt_token_ids=prompt, seed=seed, precision="float32",
                               samples=[SampleSubmit(token_ids=s.token_ids, logprobs=s.logprobs,
                                                     finish_reason=s.finish_reason) for s in samples])
        result = auditor.audit(claimed)
        if not result.passed:
            failed.append((seed, [s.token_ids for s in samples], result.reason))
    assert not failed, f"{len(failed)} of {GROUPS} honest groups failed their audit: {failed[:3]}"


def test_exact_replays_do_not_feed_the_workers_likelihood_test(api):
    """The per-worker sequential test (api/services/evidence.py) adds each audit's z: an honest low-temperature
    worker's exact replays, z = -21 each, struck it at its first such group."""
    from api.models import Worker
    from api.services import evidence
    from tests.factories import new_provider, new_worker

    wid, _ = new_worker(api, new_provider(api)[1])
    exact = {"z": -21.0, "tokens": 2.0, "replayed": 2.0, "near_ties": 0.0, "mismatches": 0.0}
    with api.db.session() as s:
        worker = s.get_one(Worker, wid)
        for _ in range(5):
            evidence.record(s, worker, exact, "float32", api.server.settings)
        assert worker.strikes == 0 and worker.evidence.get("z_lo", 0.0) == 0.0
        evidence.record(s, worker, exact | {"near_ties": 1.0}, "float32", api.server.settings)  # not exact: counted
        assert worker.strikes == 1
