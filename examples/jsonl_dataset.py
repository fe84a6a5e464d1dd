"""Bring your own data: upload a JSONL file as a dataset and train a GRPO job on it.

    export ECHO2_BASE_URL=http://127.0.0.1:8000 ECHO2_API_KEY=...
    python examples/jsonl_dataset.py examples/data/gsm8k_sample.jsonl --steps 20

Each line of the file is one JSON object. For the `gsm8k` task it needs `question` and `answer`
(a bare number, or a worked solution ending in "#### 42"); the server checks every line against the
task before it accepts the job, and names the first line that does not fit. Other keys can be mapped
with task params, e.g. `--param question_key=problem`. Follow the job afterwards with
`python examples/submit_and_watch.py --job JOB_ID` or `echo2 jobs watch JOB_ID`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from echo2 import Client, errors

SAMPLE = Path(__file__).parent / "data" / "gsm8k_sample.jsonl"


def _param(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)  # numbers and booleans keep their type
    except json.JSONDecodeError:
        return key, value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Upload a JSONL dataset and submit a GRPO job on it.")
    p.add_argument("path", nargs="?", type=Path, default=SAMPLE, help=f"JSONL file (default: {SAMPLE.name})")
    p.add_argument("--name", help="dataset and job name (default: the file name)")
    p.add_argument("--task", default="gsm8k", help="task adapter (default gsm8k)")
    p.add_argument("--param", type=_param, action="append", default=[], metavar="KEY=VALUE",
                   help="task parameter, repeatable (e.g. question_key=problem)")
    p.add_argument("--model", default="echo2:tiny", help="base model: HF id, learner-host path or echo2:tiny")
    p.add_argument("--steps", type=int, default=20, help="max learner steps")
    p.add_argument("--group-size", type=int, default=4, help="G: samples per prompt")
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--staleness", type=int, default=2, help="S: bounded staleness")
    p.add_argument("--no-job", action="store_true", help="only upload the dataset")
    args = p.parse_args(argv)

    name = args.name or args.path.stem
    if not args.path.exists():
        print(f"error: {args.path}: no such file", file=sys.stderr)
        return 2
    try:
        with Client() as client:  # ECHO2_BASE_URL / ECHO2_API_KEY
            dataset = client.datasets.upload(name, args.path)
            print(f"dataset {dataset.id}: {dataset.num_items} items, keys {', '.join(dataset.keys)}")
            if args.no_job:
                return 0
            job = client.jobs.create(
                name=name, base_model=args.model, dataset_id=dataset.id,
                task={"name": args.task, "params": dict(args.param)},
                grpo={"group_size": args.group_size, "prompts_per_step": args.prompts_per_step},
                staleness=args.staleness, max_steps=args.steps,
            )
    except errors.Echo2Error as exc:  # the server's message names the field (and line) to fix
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"job {job.id}: {job.status.value}, task {job.spec.task.name} on {job.num_prompts} training prompts "
          f"({job.spec.eval.fraction:.0%} held out for evaluation), model {job.spec.base_model}")
    print(f"follow it: python examples/submit_and_watch.py --job {job.id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
