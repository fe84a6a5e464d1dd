"""A worker computing in bfloat16 (the transformers backend's default on a GPU with bf16,
`--dtype bfloat16` elsewhere; here the shipped backend on the CPU with dtype bfloat16) on a job with top_p < 1 fails
the learner's audit in a few % of its honest groups: its nucleus, ranked in bf16, holds a token the auditor's
float32 nucleus widened by the support slack (learner/audit.py AuditConfig.support_slack: NUCLEUS_SLACK = 0.02 of
mass, or e^2r - 1) does not, and the replay calls it a token outside the support (gap 1e6). The slack bounds the
change of a set's mass, but in a flat stretch of the distribution bf16 rounding re-orders many tokens of nearly the
same probability, so the edge moves by more than 0.02 of mass. The model is the built-in `echo2:tiny`."""

from __future__ import annotations

import pytest
import torch
from echo2.loading import load_causal_lm
from echo2.protocol import ClaimedGroup, JobSpec, SampleSubmit
from echo2.seeds import sample_seed
from echo2_worker.backends import GenRequest, create_backend

from learner.auditor import Auditor


@pytest.mark.parametrize("top_p", [0.1, 0.5])
def test_honest_bf16_groups_with_top_p_pass_the_audit(tiny_dir, top_p):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    spec = JobSpec.model_validate({"name": "t", "base_model": str(tiny_dir), "task": {"name": "arithmetic"},
                                   "grpo": {"group_size": 8, "max_new_tokens": 24, "top_p": top_p}})
    backend = create_backend("transformers", device="cpu", dtype="bfloat16")
    backend.load(tiny_dir)
    prompts = [tok(f"{i}*{i + 2}=")["input_ids"] for i in range(20)]
    requests = [GenRequest(prompt_token_ids=p, n=8, seeds=[sample_seed(s, k) for k in range(8)], max_new_tokens=24,
                           temperature=1.0, top_p=top_p) for p in prompts for s in range(5)]
    groups = backend.generate(requests)
    precision = backend.precision
    backend.close()
    assert precision == "bfloat16"
    auditor = Auditor(str(tiny_dir), spec, fetch=lambda v: pytest.fail("no fetch expected"))
    model = load_causal_lm(tiny_dir, dtype=torch.float32).eval()
    auditor.remember(0, {k: v.clone() for k, v in model.state_dict().items()})
    failed = []
    for n, (request, samples) in enumerate(zip(requests, groups, strict=True)):
        seed = n % 5
        claimed = ClaimedGroup(rollout_id=f"rol_{n}", prompt_id=n // 5, prompt_text="", reference=None, version=0,
                               worker_id="wrk_honest", prompt_token_ids=request.prompt_token_ids, seed=seed,
                               precision=precision,
                               samples=[SampleSubmit(token_ids=s.token_ids, logprobs=s.logprobs,
                                                     finish_reason=s.finish_reason) for s in samples])
        result = auditor.audit(claimed)
        if not result.passed:
            failed.append((n, result.reason))
    assert not failed, f"{len(failed)} of {len(requests)} honest bf16 groups failed their audit: {failed[:2]}"
