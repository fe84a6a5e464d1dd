"""A job's metrics streamed to the experiment tracker its spec names (JobSpec.tracking), from the learner host:
each committed step's training metrics and the job's cost, each held-out evaluation.

Two small implementations behind one interface, Weights & Biases and MLflow, imported only when a job asks
(`echo2-server[trackers]`). A run is named after the job and found again by it, so a resumed learner goes on in
the same run. A tracker that fails never stops training: its error is logged once and the job goes on without it.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from echo2.protocol import EvalReport, JobSpec, StepAck, StepReport, TrackerKind, TrackingConfig

log = logging.getLogger(__name__)
JOB_TAG = "echo2_job"


class Tracker(ABC):
    @abstractmethod
    def log(self, metrics: dict[str, float], step: int) -> None:
        """Metrics at a learner step."""

    @abstractmethod
    def close(self) -> None:
        """Flush and end the run (it may be resumed later)."""


class WandbTracker(Tracker):
    def __init__(self, cfg: TrackingConfig, job_id: str, name: str, spec: JobSpec, work_dir: Path) -> None:
        import wandb

        settings = wandb.Settings(base_url=cfg.uri) if cfg.uri else None
        folder = Path(cfg.dir) if cfg.dir else work_dir
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=name, id=job_id, resume="allow",
                              mode=cfg.mode, dir=str(folder), tags=list(cfg.tags), settings=settings,
                              config=spec.model_dump(mode="json", exclude={"tracking"}))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    def __init__(self, cfg: TrackingConfig, job_id: str, name: str, spec: JobSpec, work_dir: Path) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=cfg.uri)
        experiment = self.client.get_experiment_by_name(cfg.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(cfg.project)
        found = self.client.search_runs([experiment_id], filter_string=f"tags.{JOB_TAG} = '{job_id}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            tags = {JOB_TAG: job_id, "mlflow.runName": name, **{t: "" for t in cfg.tags}}
            self.run_id = self.client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
            flat = _flatten(spec.model_dump(mode="json", exclude={"tracking"}))
            self.client.log_batch(self.run_id, params=_params(flat))

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        stamp = _now_ms()
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, stamp, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


KINDS: dict[TrackerKind, type[Tracker]] = {TrackerKind.wandb: WandbTracker, TrackerKind.mlflow: MlflowTracker}


class Tracking:
    """The job's tracker, fed from the learner loop (any thread); a no-op when the job names none, or once its
    tracker failed."""

    def __init__(self, spec: JobSpec | None, job_id: str, work_dir: Path) -> None:
        self.tracker: Tracker | None = None
        self._lock = threading.Lock()
        cfg = spec.tracking if spec is not None else None
        if spec is None or cfg is None:
            return
        name = cfg.run_name or f"{spec.name} ({job_id})"
        try:
            self.tracker = KINDS[cfg.kind](cfg, job_id, name, spec, work_dir)
            log.info("job %s streams its metrics to %s (%s)", job_id, cfg.kind.value, cfg.project)
        except Exception as exc:  # noqa: BLE001 - a tracker never stops training
            log.error("job %s: cannot start its %s run, training goes on without it: %s: %s", job_id,
                      cfg.kind.value, type(exc).__name__, exc)

    def step(self, report: StepReport, ack: StepAck) -> None:
        metrics = {"train/reward_mean": report.reward_mean, "train/reward_std": report.reward_std,
                   "train/loss": report.loss, "train/kl": report.kl, "train/clip_frac": report.clip_frac,
                   "train/tokens": report.tokens, "train/t_train_s": report.t_train_s,
                   "train/groups": len(report.rollout_ids), "train/groups_rejected": len(report.rejected),
                   "train/groups_unscored": len(report.unscored), "train/groups_dropped": report.groups_dropped,
                   "train/staleness_mean": _mean_staleness(report.staleness_hist), "cost/total_usd": ack.cost_usd}
        self._log(metrics, report.step)

    def evaluation(self, report: EvalReport) -> None:
        self._log({"heldout/greedy_accuracy": report.greedy_accuracy,
                   "heldout/sampled_accuracy": report.sampled_accuracy,
                   "heldout/sampled_reward_mean": report.sampled_reward_mean}, report.step)

    def close(self) -> None:
        with self._lock:
            if self.tracker is not None:
                self._guard(self.tracker.close)
                self.tracker = None

    def _log(self, metrics: dict[str, float | None], step: int) -> None:
        values = {k: float(v) for k, v in metrics.items() if v is not None}
        with self._lock:
            if self.tracker is not None and values:
                tracker = self.tracker
                self._guard(lambda: tracker.log(values, step))

    def _guard(self, call: Any) -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - a tracker never stops training
            log.error("the job's tracker failed, training goes on without it: %s: %s", type(exc).__name__, exc)
            self.tracker = None


def _mean_staleness(hist: list[int]) -> float | None:
    total = sum(hist)
    return sum(i * n for i, n in enumerate(hist)) / total if total else None


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out |= _flatten(v, f"{prefix}{k}.")
        return out
    return {prefix.rstrip("."): value}


def _params(flat: dict[str, Any]) -> list[Any]:
    from mlflow.entities import Param

    return [Param(k, str(v)[:500]) for k, v in flat.items() if v is not None and k != "prompts"][:100]


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)
