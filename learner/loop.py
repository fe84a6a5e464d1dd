"""The learner process: start or resume a job, then claim admissible rollouts, train, report, publish
every κ steps and checkpoint every N, until max steps, a stop from the control plane, or an error.
It talks to the control plane over HTTP only.

A job with `learner.gpus > 1` runs this same loop on rank 0 of a `torchrun` group (launch.py): the
`world` (parallel.Sharded) shards the model with FSDP, and each collective step (train, gather the
weights for a version or a checkpoint, evaluate on held-out prompts, stop) is announced to the other
ranks, which follow it (launch.follow). Only rank 0 claims, reports, heartbeats, publishes and writes
checkpoints; a LoRA job's versions are written from an unsharded copy of its base (sharded_lora.py)."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from echo2.errors import AuthenticationError
from echo2.loading import load_causal_lm
from echo2.protocol import (
    AuditReport,
    AuditVerdicts,
    ClaimedGroup,
    EvalReport,
    FinishOutcome,
    JobSpec,
    LearnerFinish,
    LearnerHeartbeat,
    LearnerStartReply,
    MismatchStats,
    RolloutRejection,
    Rounding,
    StepAck,
    StepReport,
)

from . import checkpoint, resume
from .auditor import Auditor
from .evaluate import Evaluator
from .models import resolve_model, with_adapter
from .parallel import Sharded, Solo
from .pipeline import Ahead, Committer
from .publisher import Publisher
from .remote import ControlPlane
from .rounding import Rounder
from .sharded_lora import ShardedLoraWeights
from .tracking import Tracking
from .trainer import GRPOTrainer, StepResult
from .weights import LoraWeights, Weights, published_dtype

log = logging.getLogger(__name__)
CLAIM_WAIT_S = 2.0  # a claim with nothing to take waits this long for rollouts to arrive
# Audit time spent on groups the control plane did not pick before the learner looks for rollouts again, while
# it waits for them (Learner._audit_spare): a step starts at most this much, and one audit, later than it could.
SPARE_AUDIT_S = 0.25


@dataclass
class LearnerOptions:
    work_dir: Path
    device: str = "auto"
    chunk_size: int = 8 * 2**20
    heartbeat_s: float = 2.0
    threads: int | None = None  # torch intra-op threads; 1 suits tiny models sharing a small machine


class Learner:
    def __init__(self, plane: ControlPlane, options: LearnerOptions, world: Solo | None = None) -> None:
        self.plane, self.opt, self.world = plane, options, world or Solo()
        self.started = time.monotonic()
        self.busy_s = 0.0
        self.step = 0
        self.last_ack: StepAck | None = None
        self.replayed = resume.Replay()  # what the start had to re-train to catch up with the job's records
        self.uploader = resume.CheckpointUploader(plane, options.chunk_size)
        self.evaluator: Evaluator | None = None
        self.tracking = Tracking(None, "", options.work_dir)  # the job's, once its spec is known
        self._stop = threading.Event()
        self.phase = "starting"  # what its heartbeats say it is doing (LearnerHeartbeat.state)

    def run(self) -> None:
        """Train the job to its end. An error is reported to the control plane before it propagates, so
        the scheduler relaunches at once and can tell a crash loop from progress. A token the control plane
        no longer accepts (the job ended, or a new learner took over) stops this one quietly."""
        try:
            self._run()
        except AuthenticationError as exc:
            log.info("job %s: the control plane no longer accepts this learner (%s): stopping",
                     self.plane.job_id, exc)
        except Exception as exc:
            self._report_error(exc)
            raise

    def _report_error(self, exc: Exception) -> None:
        wall = time.monotonic() - self.started
        error = f"{type(exc).__name__}: {exc}"[:500]
        try:
            self.plane.heartbeat(LearnerHeartbeat(step=self.step, busy_s=self.busy_s, wall_s=wall, state="failed",
                                                  error=error))
        except Exception as report_exc:  # the control plane may be what failed; the relaunch still comes
            log.warning("could not report the learner's error (%s): %s", report_exc, error)

    def _run(self) -> None:
        reply = self.plane.start()
        # Heartbeats from here on: converting, loading, the first publication and evaluation can take
        # minutes, and a learner silent that long is relaunched by the scheduler.
        beat = threading.Thread(target=self._heartbeat_loop, name="learner-heartbeat", daemon=True)
        beat.start()
        try:
            self._start_and_train(reply)
        finally:
            self._stop.set()

    def _start_and_train(self, reply: LearnerStartReply) -> None:
        spec = reply.job.spec
        self.step = reply.step
        work = self.opt.work_dir / self.plane.job_id
        self.phase = "starting: fetching its checkpoint" if reply.checkpoint_step else self.phase
        resume.sync_checkpoint(self.plane, work / "checkpoints", reply.checkpoint_step)
        self.phase = f"starting: preparing the base model {spec.base_model} (a built-in is converted once)"
        model_path = resolve_model(spec.base_model, self.opt.work_dir / "models", seed=spec.seed,
                                   private=(self.opt.work_dir,))
        self.world.announce("start", (spec, model_path))
        self.phase = "starting: loading the model"
        trainer, restored = build_trainer(spec, model_path, self.opt, self.world, work / "checkpoints")
        trainer.auditor = Auditor(model_path, spec, device=next(trainer.model.parameters()).device,
                                  fetch=lambda v: self.plane.fetch_version(v, work / "audit" / f"v{v}"))
        consumed = restored.consumed if restored else set()
        if restored is not None:
            log.info("resumed from checkpoint at step %d; the control plane has committed %d steps",
                     restored.step, self.step)
        self.replayed = resume.replay(self.plane, trainer, self.world, restored.step if restored else 0, self.step,
                                      consumed, reply.version)
        self.evaluator = self._evaluator(spec, trainer)
        publisher = Publisher(self.plane, trainer.weights, work / "publish", self.opt.chunk_size, spec.weights)
        self.tracking = Tracking(spec, self.plane.job_id, work / "tracking")
        try:
            self.phase = "starting: publishing the first version for the workers"
            self._publish_initial(publisher, trainer, reply.version, restored is not None or self.step > 0)
            if self.evaluator is not None and self.evaluator.due(self.step):
                self.phase = f"starting: evaluating on {len(self.evaluator.prompts)} held-out prompts"
                self._report_eval(self.evaluator.run(self.step, self.step))
            self.phase = "training"
            self._train(spec, trainer, publisher, consumed, work)
            self.world.announce("stop")
        finally:
            publisher.close()
            self.uploader.wait()
            self.tracking.close()

    def _publish_initial(self, publisher: Publisher, trainer: GRPOTrainer, server_version: int | None,
                         resumed: bool) -> None:
        """Workers need a version to generate with. On resume, the restored weights become version t
        if the server does not have one that new (versions stay monotonic either way)."""
        if server_version is None or (resumed and server_version < self.step):
            self._submit(publisher, trainer)
            publisher.wait()

    def _submit(self, publisher: Publisher, trainer: GRPOTrainer, final: bool = False) -> None:
        publisher.submit(self.step, self.step, self._snapshot(trainer, self.step), final)

    def _snapshot(self, trainer: GRPOTrainer, version: int) -> dict[str, torch.Tensor]:
        """The weights as version `version` (weights.py: a CPU copy in the published dtype), remembered for
        audits: rollouts of it may be audited until it is S steps old, under exactly what workers load."""
        state = trainer.weights.snapshot()
        if trainer.auditor is not None:
            trainer.auditor.remember(version, state)
        return state

    def _train(self, spec: JobSpec, trainer: GRPOTrainer, publisher: Publisher, consumed: set[str],
               work: Path) -> None:
        """Train step after step; the report of each and the claims of the next overlap the training of
        the one after (pipeline.py). A step trained after the job ended is not reported."""
        committer, ahead = Committer(self.plane), Ahead(self.plane, spec.grpo.prompts_per_step)
        t = self.step
        try:
            while t < spec.max_steps:
                groups = self._collect(spec, trainer, t, ahead)
                if groups is None:
                    return  # stopped from outside (cancelled, or paused: a new learner resumes it)
                result = self._trained(trainer, groups, t)
                previous = committer.wait()  # in long ago: it went out when step t started
                if previous is not None and previous.stop and previous.job_status.stops_learner():
                    return
                self._commit(spec, trainer, publisher, committer, ahead, _report(t, _kept(groups, result), result),
                             consumed)
                self._evaluate(committer, t + 1)  # queued behind step t's report: the control plane wants it in
                t += 1
                if t % spec.checkpoint_every == 0:
                    committer.wait()  # a checkpoint holds only committed steps
                    self._checkpoint(trainer, consumed, work)
                if previous is not None and previous.stop:
                    break  # the last step: it was still reported; finish with it
            last = committer.wait()
            if last is not None and last.job_status.stops_learner():
                return
        finally:
            ahead.close()
            committer.close()
        self._finish(publisher, trainer)

    def _evaluator(self, spec: JobSpec, trainer: GRPOTrainer) -> Evaluator | None:
        if spec.eval.size == 0:
            return None
        return Evaluator(spec, self.plane.eval_prompts(), trainer.model, trainer.tokenizer, trainer.pad_id,
                         self.world, computing=trainer.weights.computing)

    def _report_eval(self, report: EvalReport) -> None:
        self.plane.report_eval(report)
        self.tracking.evaluation(report)

    def _evaluate(self, committer: Committer, step: int) -> None:
        """Held-out accuracy of the weights after `step` steps, reported once that step is committed."""
        if self.evaluator is not None and self.evaluator.due(step):
            report = self.evaluator.run(step, step)
            committer.then(lambda: self._report_eval(report), f"the evaluation of step {step}")

    def _trained(self, trainer: GRPOTrainer, groups: list[ClaimedGroup], t: int) -> StepResult:
        if trainer.auditor is not None:  # versions no rollout of this step can claim any more
            trainer.auditor.keep_from(trainer.spec.oldest_admissible(t))
        start = time.perf_counter()
        result = trainer.step(groups, t)
        self.busy_s += time.perf_counter() - start
        return result

    def _commit(self, spec: JobSpec, trainer: GRPOTrainer, publisher: Publisher, committer: Committer,
                ahead: Ahead, report: StepReport, consumed: set[str]) -> None:
        """Report the step in the background; once it is acknowledged, publish the version it made (when
        one is due) and start claiming for the step after the next."""
        assert not consumed.intersection(report.rollout_ids), "a rollout would be trained twice"
        consumed.update(report.rollout_ids)
        t = report.step + 1
        state = self._snapshot(trainer, t) if t % spec.publish_period == 0 or t >= spec.max_steps else None

        def committed(ack: StepAck) -> None:
            self.step, self.last_ack = ack.step, ack
            self.tracking.step(report, ack)
            if state is not None:  # the job's last version (it stops) is published in full
                publisher.submit(ack.step, ack.step, state, final=ack.stop)
            if spec.staleness > 0 and ack.step + 1 < spec.max_steps and not ack.stop:
                ahead.start(ack.step + 1)

        committer.submit(report, committed)

    def _checkpoint(self, trainer: GRPOTrainer, consumed: set[str], work: Path) -> None:
        weights = self.world.model_state(trainer.model)
        optim = self.world.optimizer_state(trainer.model, trainer.optimizer)
        folder = checkpoint.save(work / "checkpoints", self.step, self.step, weights, optim, trainer.scheduler,
                                 consumed)
        self.uploader.submit(folder, self.step)

    def _collect(self, spec: JobSpec, trainer: GRPOTrainer, t: int, ahead: Ahead) -> list[ClaimedGroup] | None:
        """Claim until the step has prompts_per_step groups, starting from those claimed ahead (waiting
        is what utilisation measures); the groups picked for an audit are audited as they come, those
        claimed ahead for later steps too, and the verdicts sent at once (trainer.audit_claimed)."""
        want, groups = spec.grpo.prompts_per_step, ahead.take(t)
        self._send_audits(trainer, t, groups)
        spare = False  # the last claim took all there was, and groups held were audited meanwhile
        while len(groups) < want:
            if self._stopped():
                return None
            claimed = self.plane.claim(t, want - len(groups), wait_s=0.0 if spare else CLAIM_WAIT_S).groups
            self._send_audits(trainer, t, claimed)
            groups += claimed
            self._audit_ahead(trainer, ahead)
            spare = len(groups) < want and self._audit_spare(trainer, {t: groups, **ahead.held()})
        ahead.collected(t)
        return groups

    def _audit_ahead(self, trainer: GRPOTrainer, ahead: Ahead) -> None:
        """Verdicts on the groups claimed ahead so far. One that does not get through is still in the trainer's
        verdicts, and goes out with its step's report."""
        for step, held in ahead.held().items():
            try:
                self._send_audits(trainer, step, held)
            except Exception as exc:  # noqa: BLE001 - the step's own claims and report say what is wrong
                log.warning("verdicts on groups claimed ahead for step %d not sent: %s", step, exc)

    def _send_audits(self, trainer: GRPOTrainer, t: int, groups: list[ClaimedGroup]) -> None:
        self._report_audits(t, trainer.audit_claimed(groups))

    def _report_audits(self, t: int, audits: list[AuditReport]) -> None:
        if audits:
            self.plane.report_audits(AuditVerdicts(step=t, audits=audits))

    def _audit_spare(self, trainer: GRPOTrainer, held: dict[int, list[ClaimedGroup]]) -> bool:
        """The last claim took all there was and the step waits for more: audit groups held for it (or claimed
        ahead) that the control plane did not pick, for up to SPARE_AUDIT_S, instead of only waiting. A trusted
        worker has one group in each window of ten audited; with the learner's spare time more of them are, so one
        that cheats is struck sooner, at little cost to training: the next claim (not waiting, then) takes what
        arrived meanwhile. Whether any group was audited."""
        if trainer.auditor is None:
            return False
        budget, judged = SPARE_AUDIT_S, False
        for step, groups in sorted(held.items()):
            start = trainer.auditor.seconds
            audits = trainer.audit_spare(groups, budget)
            budget -= trainer.auditor.seconds - start
            try:
                self._report_audits(step, audits)
            except Exception as exc:  # noqa: BLE001 - kept in the trainer's verdicts: they go with the step's report
                log.warning("verdicts of spare audits for step %d not sent: %s", step, exc)
            judged = judged or bool(audits)
            if budget <= 0:
                break
        return judged

    def _finish(self, publisher: Publisher, trainer: GRPOTrainer) -> None:
        if publisher.submitted != self.step:
            self._submit(publisher, trainer, final=True)
        if self.evaluator is not None and self.evaluator.prompts and not self.evaluator.due(self.step):
            self._report_eval(self.evaluator.run(self.step, self.step))  # the final weights, always
        publisher.wait()
        self.plane.finish(LearnerFinish(outcome=FinishOutcome.succeeded, final_version=publisher.published,
                                        reason=f"finished {self.step} steps"))

    def _stopped(self) -> bool:
        ack = self.last_ack
        return ack is not None and ack.job_status.stops_learner()

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.opt.heartbeat_s):
            try:
                wall = time.monotonic() - self.started
                self.last_ack = self.plane.heartbeat(LearnerHeartbeat(step=self.step, busy_s=self.busy_s,
                                                                      wall_s=wall, state=self.phase))
            except Exception as exc:  # a missed heartbeat is not fatal; the next one may get through
                log.warning("learner heartbeat failed: %s", exc)


def build_trainer(spec: JobSpec, model_path: str, opt: LearnerOptions, world: Solo,
                  checkpoints: Path) -> tuple[GRPOTrainer, checkpoint.Restored | None]:
    """The model on this process's device (sharded by `world`), its trainer, and the latest checkpoint
    loaded into both. Every rank builds the same one (launch.follow)."""
    from transformers import AutoTokenizer

    if opt.threads:
        torch.set_num_threads(opt.threads)
    wanted = opt.device if opt.device != "auto" else spec.learner.device.value
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = load_causal_lm(model_path, dtype=torch.float32, use_safetensors=True)
    torch.manual_seed(spec.seed)
    model = model.to(world.device(wanted))
    if spec.learner.activation_checkpointing:
        model.gradient_checkpointing_enable()  # recompute activations in backward: memory for compute
    dtype = published_dtype(spec, model_path)
    reference = _reference(model, spec)  # a full replica on every rank: it is only read
    if reference is not None:
        Rounder(reference, dtype)  # version 0 as published: frozen, so rounded once
    if spec.lora is not None:
        model = with_adapter(model, spec.lora)
    trainer = GRPOTrainer(world.wrap(model, dtype), tokenizer, spec, reference, world)
    trainer.weights = _versions(trainer.model, tokenizer, spec, model_path, dtype, world)
    if reference is not None and spec.lora is None:
        _as_version_0(reference, trainer)
    return trainer, checkpoint.load_latest(checkpoints, trainer.model, trainer.optimizer, trainer.scheduler, world)


def _versions(model: Any, tokenizer: Any, spec: JobSpec, model_path: str, dtype: torch.dtype, world: Solo) -> Weights:
    """What the job's versions carry: the model, or a LoRA adapter (gathered from the ranks when sharded).
    A single process computes on its masters rounded to the published dtype (learner/rounding.py); FSDP casts
    them as it gathers them."""
    if spec.lora is not None and world.size > 1:
        return ShardedLoraWeights(model, tokenizer, dtype, world, model_path, spec.lora)
    dithered = spec.weights.rounding is not Rounding.nearest and dtype == torch.bfloat16  # dtype `auto` may be another
    rounder = None if isinstance(world, Sharded) else Rounder(model, dtype, dithered, seed=spec.seed)
    kind = LoraWeights if spec.lora is not None else Weights
    return kind(model, tokenizer, dtype, world, rounder)


def _reference(model: Any, spec: JobSpec) -> Any:
    if spec.grpo.kl_coef <= 0:
        return None
    import copy

    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def _as_version_0(reference: Any, trainer: GRPOTrainer) -> None:
    """The KL reference holds version 0 as published: a single process publishes its masters rounded its own way
    (dithered bf16 is not the nearest rounding the reference got), and a reference that is not version 0 pulls the
    policy towards a model nobody published. A sharded learner publishes the nearest rounding, as the reference has."""
    if isinstance(trainer.world, Sharded):
        return
    with torch.no_grad(), trainer.weights.computing():
        reference.load_state_dict(trainer.model.state_dict())


def _kept(groups: list[ClaimedGroup], result: StepResult) -> list[str]:
    """The groups the step trained on: neither refused nor left unscored."""
    return [g.rollout_id for g in groups if g.rollout_id not in result.rejected and g.rollout_id not in result.unscored]


def _report(step: int, ids: list[str], r: StepResult) -> StepReport:
    return StepReport(
        step=step, rollout_ids=ids, t_train_s=r.seconds, reward_mean=r.reward_mean, reward_std=r.reward_std,
        loss=_bounded(r.loss), kl=_bounded(r.kl), clip_frac=min(1.0, r.clip_frac), groups_dropped=r.groups_dropped,
        staleness_hist=r.staleness_hist, tokens=r.tokens,
        mismatch=[MismatchStats(**_int_counts(m)) for m in r.mismatch],
        rewards=[{"rollout_id": k, "rewards": v, "learner_logprobs": r.learner_logprobs.get(k)}
                 for k, v in r.rewards.items()],
        rejected=[RolloutRejection(rollout_id=k, reason=v[:500]) for k, v in r.rejected.items()],
        unscored=[RolloutRejection(rollout_id=k, reason=v[:500]) for k, v in r.unscored.items()],
        audits=r.audits, audit_s=r.audit_s,
    )


def _int_counts(row: dict[str, float]) -> dict[str, float | int]:
    return {**row, "staleness": int(row["staleness"]), "tokens": int(row["tokens"])}


def _bounded(value: float, limit: float = 1e9) -> float | None:
    """A metric the report can carry: never let an odd value fail the whole step report."""
    return max(-limit, min(limit, value)) if math.isfinite(value) else None
