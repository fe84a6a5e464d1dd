"""The learner process: start or resume a job, then claim admissible rollouts, train, report, publish
every κ steps and checkpoint every N, until max steps, a stop from the control plane, or an error.
It talks to the control plane over HTTP only."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from echo2.protocol import (
    ClaimedGroup,
    FinishOutcome,
    JobSpec,
    LearnerFinish,
    LearnerHeartbeat,
    StepAck,
    StepReport,
)

from . import checkpoint
from .models import resolve_model
from .publisher import Publisher
from .remote import ControlPlane
from .trainer import GRPOTrainer, StepResult

log = logging.getLogger(__name__)
POLL_S = 0.25


@dataclass
class LearnerOptions:
    work_dir: Path
    device: str = "auto"
    chunk_size: int = 8 * 2**20
    heartbeat_s: float = 2.0
    threads: int | None = None  # torch intra-op threads; 1 suits tiny models sharing a small machine


class Learner:
    def __init__(self, plane: ControlPlane, options: LearnerOptions) -> None:
        self.plane, self.opt = plane, options
        self.started = time.monotonic()
        self.busy_s = 0.0
        self.step = 0
        self.last_ack: StepAck | None = None
        self._stop = threading.Event()

    def run(self) -> None:
        if self.opt.threads:
            torch.set_num_threads(self.opt.threads)
        reply = self.plane.start()
        spec = reply.job.spec
        self.step = reply.step
        work = self.opt.work_dir / self.plane.job_id
        model, tokenizer = _load(spec, self.opt.work_dir / "models", self._device(spec))
        trainer = GRPOTrainer(model, tokenizer, spec, _reference(model, spec))
        restored = checkpoint.load_latest(work / "checkpoints", model, trainer.optimizer, trainer.scheduler)
        consumed = restored.consumed if restored else set()
        if restored is not None:
            log.info("resumed from checkpoint at step %d; the control plane has committed %d steps",
                     restored.step, self.step)
        publisher = Publisher(self.plane, model, tokenizer, work / "publish", self.opt.chunk_size)
        beat = threading.Thread(target=self._heartbeat_loop, name="learner-heartbeat", daemon=True)
        beat.start()
        try:
            self._publish_initial(publisher, reply.version, restored is not None)
            self._train(spec, trainer, publisher, consumed, work)
        finally:
            self._stop.set()
            publisher.close()

    def _device(self, spec: JobSpec) -> torch.device:
        wanted = self.opt.device if self.opt.device != "auto" else spec.learner.device.value
        if wanted == "auto":
            wanted = "cuda" if torch.cuda.is_available() else "cpu"
        return torch.device(wanted)

    def _publish_initial(self, publisher: Publisher, server_version: int | None, resumed: bool) -> None:
        """Workers need a version to generate with. On resume, the restored weights become version t
        if the server does not have one that new (versions stay monotonic either way)."""
        if server_version is None or (resumed and server_version < self.step):
            publisher.submit(version=self.step, step=self.step)
            publisher.wait()

    def _train(self, spec: JobSpec, trainer: GRPOTrainer, publisher: Publisher, consumed: set[str],
               work: Path) -> None:
        while self.step < spec.max_steps and not self._stopped():
            groups = self._collect(spec, self.step)
            if groups is None:
                return  # the job was stopped from outside (cancel, budget): nothing to finish
            start = time.perf_counter()
            result = trainer.step(groups, self.step)
            self.busy_s += time.perf_counter() - start
            ids = [g.rollout_id for g in groups]
            assert not consumed.intersection(ids), "a rollout would be trained twice"
            ack = self.plane.report(_report(self.step, ids, result))
            consumed.update(ids)
            self.step, self.last_ack = ack.step, ack
            self._after_step(spec, trainer, publisher, consumed, work)
            if ack.stop and ack.job_status.is_terminal():
                return
            if ack.stop:
                break
        self._finish(spec, publisher)

    def _after_step(self, spec: JobSpec, trainer: GRPOTrainer, publisher: Publisher, consumed: set[str],
                    work: Path) -> None:
        if self.step % spec.publish_period == 0 or self.step >= spec.max_steps:
            publisher.submit(version=self.step, step=self.step)
        if self.step % spec.checkpoint_every == 0:
            checkpoint.save(work / "checkpoints", self.step, self.step, trainer.model, trainer.optimizer,
                            trainer.scheduler, consumed)

    def _collect(self, spec: JobSpec, t: int) -> list[ClaimedGroup] | None:
        """Claim until the step has prompts_per_step groups (waiting is what utilisation measures)."""
        want, groups = spec.grpo.prompts_per_step, []
        while len(groups) < want:
            if self._stopped():
                return None
            batch = self.plane.claim(t, want - len(groups))
            groups += batch.groups
            if not batch.groups:
                time.sleep(POLL_S)
        return groups

    def _finish(self, spec: JobSpec, publisher: Publisher) -> None:
        if publisher.published != self.step:
            publisher.submit(version=self.step, step=self.step)
        publisher.wait()
        self.plane.finish(LearnerFinish(outcome=FinishOutcome.succeeded, final_version=publisher.published,
                                        reason=f"finished {self.step} steps"))

    def _stopped(self) -> bool:
        ack = self.last_ack
        return ack is not None and ack.job_status.is_terminal()

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.opt.heartbeat_s):
            try:
                wall = time.monotonic() - self.started
                self.last_ack = self.plane.heartbeat(LearnerHeartbeat(step=self.step, busy_s=self.busy_s,
                                                                      wall_s=wall))
            except Exception as exc:  # a missed heartbeat is not fatal; the next one may get through
                log.warning("learner heartbeat failed: %s", exc)


def _load(spec: JobSpec, cache: Path, device: torch.device) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(spec.base_model, cache, seed=spec.seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, use_safetensors=True)
    torch.manual_seed(spec.seed)
    return model.to(device), tokenizer


def _reference(model: Any, spec: JobSpec) -> Any:
    if spec.grpo.kl_coef <= 0:
        return None
    import copy

    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def _report(step: int, ids: list[str], r: StepResult) -> StepReport:
    return StepReport(
        step=step, rollout_ids=ids, t_train_s=r.seconds, reward_mean=r.reward_mean, reward_std=r.reward_std,
        loss=r.loss, kl=r.kl, clip_frac=min(1.0, r.clip_frac), groups_dropped=r.groups_dropped,
        staleness_hist=r.staleness_hist, tokens=r.tokens,
        rewards=[{"rollout_id": k, "rewards": v} for k, v in r.rewards.items()],
    )
