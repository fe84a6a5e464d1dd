"""`jobs submit` and `jobs estimate` flags and files -> a job spec (a dict the server validates)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .common import UsageError

_FLAG_PATHS = {
    "dataset": "dataset_id", "steps": "max_steps", "staleness": "staleness",
    "publish_period": "publish_period", "num_prompts": "num_prompts", "budget": "budget_usd",
    "seed": "seed", "priority": "priority",
    "group_size": "grpo.group_size", "prompts_per_step": "grpo.prompts_per_step", "lr": "grpo.lr",
    "max_new_tokens": "grpo.max_new_tokens",
}


def spec_from_args(args: argparse.Namespace) -> dict[str, Any]:
    spec: dict[str, Any] = read_spec(args.file) if args.file else {}
    if args.model:
        spec["base_model"] = args.model
    task = _task(spec.get("task"), args)
    if task is not None:
        spec["task"] = task
    if not args.file and (not spec.get("base_model") or not spec.get("task")):
        raise UsageError("give --file SPEC.json, or --model and --task")
    if args.name:
        spec["name"] = args.name
    named(spec)
    for flag, path in _FLAG_PATHS.items():
        value = getattr(args, flag)
        if value is not None:
            set_path(spec, path, value)
    for path, value in args.sets:
        set_path(spec, path, value)
    return spec


def named(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec with the default name where it has none, the task's and the model's ("arithmetic-tiny"). A file
    missing its model or task keeps no name either: validation then names what is missing (base_model, task)."""
    task, model = spec.get("task"), spec.get("base_model")
    task_name = task.get("name", "job") if isinstance(task, dict) else task
    if "name" not in spec and isinstance(task_name, str) and task_name and isinstance(model, str) and model:
        model_tail = model.rstrip("/").split("/")[-1].replace(":", "-")
        spec["name"] = f"{task_name}-{model_tail}"[:128]
    return spec


def _task(task: Any, args: argparse.Namespace) -> Any:
    """The spec file's task with --task and --param applied; a task given as a bare name becomes an object."""
    if isinstance(task, str):
        task = {"name": task}
    if args.task:
        task = {"name": args.task} if not isinstance(task, dict) or task.get("name") != args.task else task
    if args.param:
        if not isinstance(task, dict):
            raise UsageError("--param needs a task: give --task or a spec file with one")
        task = {**task, "params": {**(task.get("params") or {}), **dict(args.param)}}
    return task


def read_spec(path: str) -> dict[str, Any]:
    try:
        text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()  # noqa: SIM115
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object (the job spec)")
    return data


def set_path(spec: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = spec
    for part in parents:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UsageError(f"cannot set {path}: {part} is not an object")
        node = child
    node[leaf] = value
