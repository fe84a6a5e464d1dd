"""Launching a job's learner, as the learner host does it (scheduler/celery_app.py `run_learner`).

`learner.gpus` 0 or 1: the learner runs in this process (loop.Learner). More: this process starts
`torchrun --standalone --nproc_per_node=N -m learner.launch ...` (as `python -m torch.distributed.run`)
and waits for it; each rank runs `main` below. Rank 0 runs the same loop.Learner as a single process
would, with a `parallel.Sharded` world; the other ranks `follow` its announcements. The learner token
reaches the ranks in the environment (ECHO2_LEARNER_TOKEN), never on a command line. On CUDA each rank
takes GPU LOCAL_RANK and FSDP reduces over NCCL; without CUDA the same code runs on CPU processes
over gloo (that is how it is tested). If any rank fails, torchrun stops the others and exits non-zero,
and `run_job` raises with the tail of its log; the job's learner is then relaunched like any dead one.
torchrun is started through `learner.tether`, so it also stops if this process is killed outright.

On a learner host with GPUs the scheduler names the GPUs of the job's slots (`devices`, their ids on this
host): the learner then always runs in a child process whose CUDA_VISIBLE_DEVICES is exactly those, a
single-process learner as `python -m learner.launch --solo`, so that concurrent learners never share a
card and each one's CUDA context and memory go with its process. Its GPU is then `cuda:0`, and rank r of a
torchrun group takes the r-th of them.
"""

from __future__ import annotations

import argparse
import collections
import gc
import logging
import os
import subprocess
import sys
from pathlib import Path

from echo2 import logs
from echo2.protocol import EvalPrompt

from . import tether
from .evaluate import Evaluator
from .exclusive import sole_learner
from .loop import Learner, LearnerOptions, build_trainer
from .parallel import Sharded
from .remote import ControlPlane
from .trainer import StepResult

log = logging.getLogger(__name__)
TOKEN_ENV = "ECHO2_LEARNER_TOKEN"


def run_job(server: str, token: str, job_id: str, options: LearnerOptions, devices: list[str] | None = None) -> None:
    """Run the job's learner to its end, in this process or as a child (a torchrun group, or a learner
    pinned to `devices`); never two at once on this host (learner/exclusive.py)."""
    with sole_learner(options.work_dir, job_id, token) as sole:
        if sole:
            _run(server, token, job_id, options, devices)


def _run(server: str, token: str, job_id: str, options: LearnerOptions, devices: list[str] | None) -> None:
    plane = ControlPlane(server, token, job_id)
    try:
        gpus = plane.start().job.spec.learner.gpus
        if gpus <= 1 and devices is None:
            Learner(plane, options).run()
            return
    finally:
        plane.close()
    argv, env = learner_process(server, token, job_id, options, gpus, devices)
    _supervise(argv, env, job_id)


def learner_process(server: str, token: str, job_id: str, options: LearnerOptions, gpus: int,
                    devices: list[str] | None) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a learner in a child process: one rank a GPU (torchrun) for
    `gpus` > 1, else one process (`--solo`); with `devices`, it sees only those GPUs."""
    if devices is not None and len(devices) < max(1, gpus):
        raise ValueError(f"job {job_id} needs {max(1, gpus)} GPU(s) and was placed on {len(devices)}: {devices}")
    env = {**os.environ, TOKEN_ENV: token, tether.PARENT_ENV: str(os.getpid())}
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    if gpus > 1:
        return torchrun_argv(server, job_id, options, gpus), env
    return [sys.executable, "-m", "learner.tether", sys.executable, "-m", "learner.launch", "--solo",
            *_learner_args(server, job_id, options)], env


def torchrun_argv(server: str, job_id: str, options: LearnerOptions, processes: int) -> list[str]:
    """torchrun, tethered to this process (learner/tether.py): if the host dies, the group stops."""
    return [sys.executable, "-m", "learner.tether",
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
            "-m", "learner.launch", *_learner_args(server, job_id, options)]


def _learner_args(server: str, job_id: str, options: LearnerOptions) -> list[str]:
    argv = ["--job", job_id, "--server", server, "--work-dir", str(options.work_dir), "--device", options.device,
            "--chunk-size", str(options.chunk_size), "--heartbeat-s", str(options.heartbeat_s)]
    return argv + (["--threads", str(options.threads)] if options.threads else [])


def _supervise(argv: list[str], env: dict[str, str], job_id: str) -> None:
    """Run the learner's child to its end, its log passed through; raise with the end of it if it failed."""
    what = "torchrun" if "torch.distributed.run" in argv else "its process"
    log.info("job %s: starting %s on GPU(s) %s", job_id, " ".join(argv[4:10]), env.get("CUDA_VISIBLE_DEVICES", "-"))
    tail: collections.deque[str] = collections.deque(maxlen=30)
    with subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True, errors="replace") as proc:
        assert proc.stderr is not None
        for line in proc.stderr:  # passed through, and the end kept for the error
            sys.stderr.write(line)
            tail.append(line)
    if proc.returncode != 0:
        raise RuntimeError(f"the learner of job {job_id} failed: {what} exited with {proc.returncode}; "
                           f"end of its log:\n{''.join(tail)}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m learner.launch",
                                     description=f"one rank of a multi-process learner (token in {TOKEN_ENV})")
    parser.add_argument("--job", required=True)
    parser.add_argument("--server", required=True)
    parser.add_argument("--work-dir", required=True, type=Path)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--chunk-size", type=int, default=8 * 2**20)
    parser.add_argument("--heartbeat-s", type=float, default=2.0)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--solo", action="store_true", help="the whole learner in this process (not a rank)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_rank_main)(_parse(argv))


def _rank_main(args: argparse.Namespace) -> int:
    options = LearnerOptions(work_dir=args.work_dir, device=args.device, chunk_size=args.chunk_size,
                             heartbeat_s=args.heartbeat_s, threads=args.threads)
    if args.solo:
        return _solo_main(args, options)
    world = Sharded(local_rank=int(os.environ["LOCAL_RANK"]))  # set by torchrun
    # ECHO2_LOG_FORMAT comes down from the learner host in the environment torchrun passes on.
    logs.configure(logs.env_format(), logging.INFO if world.rank == 0 else logging.WARNING,
                   text=f"%(asctime)s rank {world.rank} %(levelname)s %(name)s: %(message)s")
    log.info("job %s: FSDP learner over %d processes", args.job, world.size)
    try:
        if world.rank == 0:
            plane = ControlPlane(args.server, os.environ[TOKEN_ENV], args.job)
            try:
                Learner(plane, options, world).run()
            finally:
                plane.close()
        else:
            follow(world, options, args.job)
    finally:
        # FSDP state holds the gloo groups; a model kept alive by a reference cycle until exit would
        # destroy them during static destruction, with their threads still joinable (std::terminate,
        # seen once as SIGABRT after a successful finish). Free it first, then end the group.
        gc.collect()
        world.close()
    return 0


def _solo_main(args: argparse.Namespace, options: LearnerOptions) -> int:
    """A single-process learner in a child of the learner host (pinned to its GPU by CUDA_VISIBLE_DEVICES)."""
    logs.configure(logs.env_format(), logging.INFO)
    plane = ControlPlane(args.server, os.environ[TOKEN_ENV], args.job)
    try:
        Learner(plane, options).run()
    finally:
        plane.close()
    return 0


def follow(world: Sharded, options: LearnerOptions, job_id: str) -> None:
    """A rank other than 0: build the same trainer, then do what rank 0 announces until "stop"."""
    command, (spec, model_path) = world.receive()
    assert command == "start", command
    trainer, _ = build_trainer(spec, model_path, options, world, options.work_dir / job_id / "checkpoints")

    def evaluate(payload: tuple[int, int, list[EvalPrompt]]) -> None:
        step, version, prompts = payload
        Evaluator(spec, prompts, trainer.model, trainer.tokenizer, trainer.pad_id, world).run(step, version)

    handlers = {
        "optimise": lambda payload: trainer.optimise(payload[0], StepResult(), payload[1]),
        "model_state": lambda _: world.model_state(trainer.model),
        "optimizer_state": lambda _: world.optimizer_state(trainer.model, trainer.optimizer),
        "trainable_state": lambda _: world.trainable_state(trainer.model),
        "evaluate": evaluate,
    }
    while (message := world.receive())[0] != "stop":
        handlers[message[0]](message[1])


if __name__ == "__main__":
    sys.exit(main())
