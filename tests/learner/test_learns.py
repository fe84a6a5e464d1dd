"""The key risk: GRPO with our objective teaches the random-init tiny model the demo task.

In-process (no server): the model samples G completions per prompt, the `arithmetic` task scores
them (accuracy of the final answer, nothing shaped), `grpo_update` takes one AdamW step. With the
demo defaults (tasks/arithmetic.py: DEMO_DEFAULTS) the mean reward of each step's own samples
starts below 0.2 and must reach 0.8 (3-step moving average), and greedy decoding on every distinct
problem must then score >= 0.8 too (training goes on until it does), all within `max_steps`.
One run samples with stale weights (staleness 1, like an asynchronous worker one version behind)
so that ratio clipping and the staleness cap are live.
"""

from __future__ import annotations

import collections
import copy
import logging
import time
from pathlib import Path

import pytest
import torch
from echo2.loading import load_causal_lm

from learner.objective import ObjectiveConfig
from learner.policy import Rollouts, grpo_update, sample
from learner.tiny import build_tiny_model
from tasks import derive_seed, get_task
from tasks.arithmetic import DEMO_DEFAULTS

log = logging.getLogger(__name__)
D = DEMO_DEFAULTS


def _greedy_accuracy(model, tok, task, params) -> float:
    """On the training problems: this test is about learning what it trains on (the demo's held-out
    problems are measured by the job's own evaluation, docs/BENCHMARKS.md)."""
    prompts = task.all_prompts(params, held=False)
    ids = [tok(p.text)["input_ids"] for p in prompts]
    out = sample(model, ids, max_new_tokens=D["max_new_tokens"], eos_id=tok.eos_token_id,
                 pad_id=tok.pad_token_id, temperature=0.0)
    texts = [tok.decode(s.completion_ids, skip_special_tokens=True) for s in out]
    return sum(task.reward(p, t, params) for p, t in zip(prompts, texts, strict=True)) / len(prompts)


def _sample_step(model, tok, task, params, step: int, seed: int):
    """One step's rollouts from `model`, scored by the task."""
    prompts = task.generate_prompts(params, derive_seed("test_learns", seed, step), D["prompts_per_step"])
    prompt_ids, group_ids, refs = [], [], []
    for g, p in enumerate(prompts):
        ids = tok(p.text)["input_ids"]
        prompt_ids += [ids] * D["group_size"]
        group_ids += [g] * D["group_size"]
        refs += [p] * D["group_size"]
    out = sample(model, prompt_ids, max_new_tokens=D["max_new_tokens"], eos_id=tok.eos_token_id,
                 pad_id=tok.pad_token_id, temperature=D["temperature"],
                 seed=derive_seed("test_learns_sample", seed, step))
    texts = [tok.decode(s.completion_ids, skip_special_tokens=True) for s in out]
    rewards = [task.reward(p, t, params) for p, t in zip(refs, texts, strict=True)]
    return prompt_ids, out, rewards, group_ids


def run_grpo(workdir: Path, *, seed: int, staleness: int, max_steps: int) -> dict:
    # One intra-op thread: these matrices are tiny, and on a shared 2-core box two OpenMP threads
    # were measured 5-8x slower per step than one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_grpo(workdir, seed=seed, staleness=staleness, max_steps=max_steps)
    finally:
        torch.set_num_threads(threads)


def _run_grpo(workdir: Path, *, seed: int, staleness: int, max_steps: int) -> dict:
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    folder = build_tiny_model(workdir / f"tiny-{seed}", seed=seed)
    model = load_causal_lm(folder, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    task = get_task(D["task"])
    params = task.parse_params(D["task_params"])
    cfg = ObjectiveConfig(eps_low=D["eps_low"], eps_high=D["eps_high"], ratio_cap=D["ratio_cap"],
                          kl_coef=D["kl_coef"], length_norm=D["length_norm"], scale_by_std=D["scale_by_std"],
                          max_len=D["max_new_tokens"])
    opt = torch.optim.AdamW(model.parameters(), lr=D["lr"], betas=tuple(D["adam_betas"]),
                            weight_decay=D["weight_decay"])
    behaviour = copy.deepcopy(model)
    versions: collections.deque = collections.deque(maxlen=staleness + 1)  # weights of the last S+1 steps
    result = {
        "rewards": [],
        "eval_start": _greedy_accuracy(model, tok, task, params),
        "reached": None,  # first step whose 3-step mean sample reward >= target
        "reached_greedy": None,  # first step after that whose greedy accuracy >= target
        "eval_end": 0.0,
    }
    start = time.perf_counter()
    for step in range(max_steps):
        versions.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        behaviour.load_state_dict(versions[0])  # the oldest kept version: staleness len(versions) - 1
        behaviour.eval()
        prompt_ids, out, rewards, group_ids = _sample_step(behaviour, tok, task, params, step, seed)
        rollouts = Rollouts(prompt_ids, [s.completion_ids for s in out], [s.logprobs for s in out],
                            rewards, group_ids, [len(versions) - 1] * len(out))
        stats = grpo_update(model, opt, rollouts, cfg, temperature=D["temperature"],
                            grad_clip=D["grad_clip"], pad_id=tok.pad_token_id)
        result["rewards"].append(sum(rewards) / len(rewards))
        log.info("step %d reward %.3f %s", step, result["rewards"][-1], stats)
        recent = result["rewards"][-3:]
        if result["reached"] is None and len(recent) == 3 and sum(recent) / 3 >= D["target_reward"]:
            result["reached"] = step
        if result["reached"] is not None:  # then train on until greedy decoding is as good (cheap: 25 prompts)
            model.eval()
            result["eval_end"] = _greedy_accuracy(model, tok, task, params)
            if result["eval_end"] >= D["target_reward"]:
                result["reached_greedy"] = step
                break
    result["wall_s"] = time.perf_counter() - start
    result["steps"] = len(result["rewards"])
    return result


@pytest.mark.parametrize(("seed", "staleness"), [(0, 0), (1, 1)])
def test_tiny_model_learns_arithmetic(tmp_path, seed, staleness):
    r = run_grpo(tmp_path, seed=seed, staleness=staleness, max_steps=D["max_steps"])
    summary = (f"seed={seed} S={staleness} start={r['rewards'][0]:.3f} eval_start={r['eval_start']:.2f} "
               f"reached={r['reached']} reached_greedy={r['reached_greedy']} eval_end={r['eval_end']:.2f} "
               f"wall={r['wall_s']:.1f}s "
               f"per_step={r['wall_s'] / r['steps']:.2f}s")
    log.warning(summary)
    assert r["rewards"][0] <= 0.2 and r["eval_start"] <= 0.2, summary
    assert r["reached"] is not None, summary
    assert r["reached_greedy"] is not None and r["eval_end"] >= D["target_reward"], summary
