"""Rollout audits on a real model: honest false rejections per backend and precision, catch rates per
forgery, and what auditing costs the learner — measured, side by side, in one run.

    python bench/audit.py                          # 400 honest groups per backend/dtype, 200 per forgery
    python bench/audit.py --groups 100 --forged 50 --no-vllm
    python bench/audit.py --groups 200 --forged 80 --vllm-dtypes float32     # both backends, 1,040 groups
    python bench/audit.py --cost-only                # what auditing costs the learner, nothing else

Model: SmolLM2-135M-Instruct (the packaged GGUF, converted once to an HF folder in bf16, as a bf16
version would be published) on two-digit addition ("what is 37+45?" with its chat template), G = 8,
16 new tokens. Honest groups come from the worker's own backends: transformers on CPU (fp32 compute),
and vLLM CPU both in fp32 and in its default bf16 (bench/vllm_generate.py, in .venv-vllm), at
temperature 1.0 / top-p 1.0 and at temperature 0.7 / top-p 0.9, half each. Forged groups are made
from honest ones (or generated the way a forger would):
  flip          one token of one sample replaced by a random vocabulary token, logprobs left alone
  random        every token random (an eos ending kept), logprob 0.0 each
  random-match  the same tokens, logprobs recomputed under the claimed model
  other         tokens and logprobs of another model (SmolLM2 with Gaussian noise of 5 % of each tensor's
                std added: another fine-tune, or a stale version)
  other-match   the same tokens, logprobs recomputed under the claimed model
  hot           sampled at twice the temperature, logprobs at that temperature
  hot-match     the same tokens, logprobs recomputed at the job's temperature
  invented      honest tokens, logprobs drawn uniformly from [-3, 0]
Each audit is learner/audit.py's `audit_group` with its default AuditConfig, on the learner's side of
the same model (fp32 compute of the published weights), with the bf16 shadow for a group claiming bf16 as
the learner's auditor has. Cost: seconds per audited group against the learner's seconds per group of a
GRPO update (learner.policy.grpo_update, forward + backward) on the same groups, in the same run; at audit
rate a, auditing costs about a × that ratio of learner time. Then the same groups claiming bf16, audited
without the shadow and with it: what the shadow adds to such a group's audit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from echo2.loading import load_causal_lm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
# This tree's SDK and worker first: the vLLM venv's editable installs may point at another checkout.
VLLM_ENV = {**os.environ, "PYTHONPATH": f"{REPO / 'sdk'}:{REPO / 'workers'}"}
CACHE = REPO / ".echo2-cache" / "smollm2-135m-instruct"
G, NEW_TOKENS = 8, 16
SETTINGS = ((1.0, 1.0), (0.7, 0.9))


@dataclass
class Group:
    prompt: list[int]
    samples: list[tuple[list[int], list[float]]]
    temperature: float
    top_p: float
    seed: int | None = None  # the leased base seed: sample k drew with sample_seed(seed, k)
    precision: str = "float32"


def requests(tok: Any, n: int, seed: int) -> list[dict[str, Any]]:
    from echo2.prompting import encode_prompt
    from echo2.seeds import sample_seed

    rng = random.Random(seed)
    out = []
    for i in range(n):
        t, p = SETTINGS[i % 2]
        text = f"What is {rng.randint(10, 99)}+{rng.randint(10, 99)}? Answer with the number only."
        base = rng.getrandbits(31)
        out.append({"prompt_token_ids": encode_prompt(tok, text), "n": G, "seeds": [sample_seed(base, k) for k in
                    range(G)], "max_new_tokens": NEW_TOKENS, "temperature": t, "top_p": p, "base": base})
    return out


def _request(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if k != "base"}


def generate_transformers(model_dir: Path, reqs: list[dict[str, Any]], temperature_scale: float = 1.0) -> list[Group]:
    from echo2_worker.backends import GenRequest, create_backend

    backend = create_backend("transformers", device="cpu")
    backend.load(model_dir)
    try:
        groups = []
        for start in range(0, len(reqs), 8):
            part = reqs[start:start + 8]
            batch = [GenRequest(**{**_request(r), "temperature": r["temperature"] * temperature_scale})
                     for r in part]
            for raw, r, out in zip(part, batch, backend.generate(batch), strict=True):
                groups.append(Group(r.prompt_token_ids, [(s.token_ids, s.logprobs) for s in out],
                                    r.temperature, r.top_p, raw["base"]))
        return groups
    finally:
        backend.close()


def generate_vllm(model_dir: Path, reqs: list[dict[str, Any]], dtype: str, work: Path) -> list[Group]:
    (work / "req.json").write_text(json.dumps([_request(r) for r in reqs]))
    out = work / f"vllm-{dtype}.json"
    subprocess.run([str(VLLM_PYTHON), str(REPO / "bench" / "vllm_generate.py"), "--model", str(model_dir),
                    "--requests", str(work / "req.json"), "--out", str(out), "--dtype", dtype], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO, env=VLLM_ENV)
    return [Group(r["prompt_token_ids"], [(s["token_ids"], s["logprobs"]) for s in g], r["temperature"], r["top_p"],
                  r["base"], dtype) for r, g in zip(reqs, json.loads(out.read_text()), strict=True)]


def recomputed(model: Any, g: Group, pad_id: int) -> Group:
    """The same tokens with logprobs made to match the claimed model (the forger's best effort)."""
    import torch

    from learner.policy import completion_logprobs, pad_batch

    comps = [t for t, _ in g.samples]
    batch = pad_batch([g.prompt] * len(comps), comps, pad_id)
    with torch.no_grad():
        lp = completion_logprobs(model, batch, temperature=g.temperature)
    samples = [(t, lp[i, : len(t)].tolist()) for i, t in enumerate(comps)]
    return Group(g.prompt, samples, g.temperature, g.top_p, g.seed)


def forgeries(honest: list[Group], model: Any, pad_id: int, vocab: int, eos: int, other: list[Group],
              hot: list[Group], n: int, rng: random.Random) -> dict[str, list[Group]]:
    def flip(g: Group) -> Group:
        samples = list(g.samples)
        tokens, lps = samples[0]
        j = rng.randrange(len(tokens))
        tokens = [*tokens[:j], (tokens[j] + rng.randrange(1, vocab)) % vocab, *tokens[j + 1:]]
        samples[0] = (tokens, lps)
        return Group(g.prompt, samples, g.temperature, g.top_p, g.seed)

    def rand(g: Group) -> Group:
        samples = [([rng.randrange(vocab) for _ in t[:-1]] + [t[-1] if t[-1] == eos else rng.randrange(vocab)],
                    [0.0] * len(t)) for t, _ in g.samples]
        return Group(g.prompt, samples, g.temperature, g.top_p, g.seed)

    def invent(g: Group) -> Group:
        return Group(g.prompt, [(t, [rng.uniform(-3, 0) for _ in t]) for t, _ in g.samples], g.temperature, g.top_p,
                     g.seed)

    base = honest[:n]
    randoms = [rand(g) for g in base]
    claimed = [Group(g.prompt, g.samples, g.temperature / 2, g.top_p, g.seed) for g in hot[:n]]  # the job's T
    return {
        "flip": [flip(g) for g in base], "random": randoms,
        "random-match": [recomputed(model, g, pad_id) for g in randoms],
        "other": other[:n], "other-match": [recomputed(model, g, pad_id) for g in other[:n]],
        "hot": claimed, "hot-match": [recomputed(model, g, pad_id) for g in claimed],
        "invented": [invent(g) for g in base],
    }


def audit_all(model: Any, groups: list[Group], shadows: dict[str, Any] | None = None) -> list[Any]:
    """learner/audit.py's audit of each group, the replay with its leased seed included; a group claiming a
    precision in `shadows` also re-scored by that shadow, as the learner's auditor does (learner/auditor.py)."""
    from learner.audit import GroupClaim, audit_group

    return [audit_group(model, GroupClaim(prompt=g.prompt, samples=g.samples, temperature=g.temperature,
                                          top_p=g.top_p, seed=g.seed, precision=g.precision), None,
                        (shadows or {}).get(g.precision)) for g in groups]


def shadows(model_dir: Path) -> dict[str, Any]:
    """The fp32 auditor's shadows by claimed precision (learner/audit.py::shadow_dtype)."""
    import torch

    return {"bfloat16": load_causal_lm(model_dir, dtype=torch.bfloat16).eval()}


def train_seconds_per_group(model_dir: Path, groups: list[Group], pad_id: int, micro_batch_tokens: int) -> float:
    import torch

    from learner.objective import ObjectiveConfig
    from learner.policy import Rollouts, grpo_update

    model = load_causal_lm(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rows = Rollouts()
    for gi, g in enumerate(groups):
        for k, (t, lp) in enumerate(g.samples):
            rows.add(g.prompt, t, lp, float(k == 0), gi, 0)
    start = time.perf_counter()
    grpo_update(model, opt, rows, ObjectiveConfig(), pad_id=pad_id, temperature=1.0,
                max_tokens_per_micro_batch=micro_batch_tokens)
    return (time.perf_counter() - start) / len(groups)


def perturbed(model_dir: Path, out: Path, scale: float = 0.05) -> Path:
    import torch
    from transformers import AutoTokenizer

    model = load_causal_lm(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * scale)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def main() -> None:
    args = _parse()
    import torch
    from transformers import AutoTokenizer

    from learner.tiny import import_smollm2

    torch.manual_seed(0)
    model_dir = CACHE if (CACHE / "config.json").exists() else import_smollm2(CACHE)
    work = Path(tempfile.mkdtemp(prefix="echo2-audit-"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = load_causal_lm(model_dir, dtype=torch.float32).eval()
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    shadow = shadows(model_dir)
    if args.cost_only:
        groups = generate_transformers(model_dir, requests(tok, args.cost_groups, seed=4))
        _report_cost(model, model_dir, groups, pad_id, args.micro_batch_tokens, shadow)
        return
    reqs = requests(tok, args.groups, seed=1)
    start = time.perf_counter()
    honest = {"transformers fp32": generate_transformers(model_dir, reqs)}
    print(f"generated {len(reqs)} groups with transformers in {time.perf_counter() - start:.0f} s", flush=True)
    if args.vllm and VLLM_PYTHON.exists():
        for dtype in args.vllm_dtypes:
            start = time.perf_counter()
            honest[f"vLLM {dtype.replace('float32', 'fp32').replace('bfloat16', 'bf16')}"] = \
                generate_vllm(model_dir, reqs, dtype, work)
            print(f"generated {len(reqs)} groups with vLLM {dtype} in {time.perf_counter() - start:.0f} s", flush=True)
    forged_reqs = requests(tok, args.forged, seed=2)
    other = generate_transformers(perturbed(model_dir, work / "other"), forged_reqs)
    hot = generate_transformers(model_dir, forged_reqs, temperature_scale=2.0)
    rng = random.Random(3)
    _report_honest(model, honest, pad_id, shadow)
    forged = forgeries(honest["transformers fp32"], model, pad_id, model.get_input_embeddings().num_embeddings,
                       tok.eos_token_id, other, hot, args.forged, rng)
    _report_forged(model, forged, pad_id)
    cost_groups = honest["transformers fp32"][:args.cost_groups]
    del honest, forged, other, hot  # the cost stage's backward pass needs the memory
    _report_cost(model, model_dir, cost_groups, pad_id, args.micro_batch_tokens, shadow)


def _report_honest(model: Any, honest: dict[str, list[Group]], pad_id: int, shadow: dict[str, Any]) -> None:
    print(f"{'honest groups':<22} {'groups':>6} {'rejected':>9} {'max |Δ| nat':>11} {'p99.9 |Δ|':>9} "
          f"{'|z| max':>8} {'rounding':>8}  without the shadow")
    for name, groups in honest.items():
        results = audit_all(model, groups, shadow)
        worst = sorted(r.max_abs_diff for r in results)
        rejected = [r for r in results if not r.passed]
        rounding = max((r.rounding for r in results if r.rounding is not None), default=None)
        unshadowed = "-" if rounding is None else f"{sum(not r.passed for r in audit_all(model, groups)):,} rejected"
        print(f"{name:<22} {len(results):>6} {len(rejected) / len(results):>9.2%} {worst[-1]:>11.4f} "
              f"{worst[int(0.999 * (len(worst) - 1))]:>9.4f} {max(abs(r.z) for r in results):>8.2f} "
              f"{'-' if rounding is None else f'{rounding:.4f}':>8}  {unshadowed}", flush=True)
        for r in rejected[:3]:
            print(f"    rejected: {r.reason}")


def _report_forged(model: Any, forged: dict[str, list[Group]], pad_id: int) -> None:
    print(f"\n{'forged groups':<22} {'groups':>6} {'caught':>9}  typical reason")
    for name, groups in forged.items():
        results = audit_all(model, groups)
        caught = [r for r in results if not r.passed]
        reason = (caught[0].reason or "")[:70] if caught else "-"
        print(f"{name:<22} {len(results):>6} {len(caught) / len(results):>9.2%}  {reason}", flush=True)


def _report_cost(model: Any, model_dir: Path, groups: list[Group], pad_id: int, micro_batch_tokens: int,
                 shadow: dict[str, Any]) -> None:
    audit_s = _seconds_per_group(lambda: audit_all(model, groups), groups)
    train_s = train_seconds_per_group(model_dir, groups, pad_id, micro_batch_tokens)
    print(f"\ncost over {len(groups)} groups (micro-batches of {micro_batch_tokens} tokens): "
          f"{audit_s * 1000:.0f} ms to audit a group, {train_s * 1000:.0f} ms to train it "
          f"(ratio {audit_s / train_s:.2f}); at the default audit rate 10 % auditing costs "
          f"{0.1 * audit_s / (train_s + 0.1 * audit_s):.1%} of learner time")
    bf16 = [replace(g, precision="bfloat16") for g in groups]  # the same groups, claiming bf16
    plain, shadowed = (_seconds_per_group(lambda s=s: audit_all(model, bf16, s), groups) for s in (None, shadow))
    print(f"a group claiming bf16: {plain * 1000:.0f} ms to audit without its shadow, {shadowed * 1000:.0f} ms "
          f"with it ({shadowed / plain:.2f}x)")


def _seconds_per_group(run: Any, groups: list[Group]) -> float:
    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) / len(groups)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=400, help="honest groups per backend/dtype")
    p.add_argument("--forged", type=int, default=200, help="groups per forgery kind")
    p.add_argument("--no-vllm", dest="vllm", action="store_false")
    p.add_argument("--vllm-dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"],
                   help="vLLM's compute dtypes (bf16 on a CPU without native bf16 is the slowest part of the run)")
    p.add_argument("--cost-only", action="store_true", help="measure only what auditing costs the learner")
    p.add_argument("--cost-groups", type=int, default=32, help="groups the cost stage audits and trains on")
    p.add_argument("--micro-batch-tokens", type=int, default=4096,
                   help="the learner's micro-batch in the cost stage (16,384, JobSpec's default, needs ~20 GB "
                        "for a 49k vocabulary in fp32)")
    return p.parse_args()


if __name__ == "__main__":
    main()
