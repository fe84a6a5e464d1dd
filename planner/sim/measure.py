"""What the scheduler knows of each worker, as a server could measure it: heartbeat liveness, the price,
nominal μ and T_gen, the last observed T_bcast or an estimate for a worker that has not fetched yet, each
off by its measurement error. The figures are taken for the whole fleet at once (numpy, one row per
worker) and a worker's WorkerProfile is rebuilt only when its row changed, in a WorkerTable kept from tick
to tick: at 100,000 workers, building every profile on every tick was most of a run."""

from __future__ import annotations

import math
import random
from operator import attrgetter

import numpy as np

from planner.capacity import WorkerPerf, WorkerProfile
from planner.sim.dissemination import Dissemination
from planner.sim.scenario import Scenario
from planner.sim.state import JobState, WorkerState
from planner.workers import WorkerTable


class Measurements:
    def __init__(
        self, scenario: Scenario, rng: random.Random, workers: list[WorkerState], dissemination: Dissemination
    ) -> None:
        self.sc = scenario
        self.rng = rng
        self.workers = workers
        self.dissemination = dissemination
        self.down = np.array([w.spec.down_Bps for w in workers])
        self.concurrency = np.array([w.spec.concurrency for w in workers], dtype=float)
        self.t_gen_ref = np.array([w.spec.t_gen_s for w in workers])
        self.errors: np.ndarray | None = None  # (μ, T_bcast) relative error per worker
        self.estimates: dict[str, tuple[tuple[float, int], np.ndarray]] = {}  # job -> (relay hint, T_bcast each)
        self.table = WorkerTable(())
        self.rows: np.ndarray | None = None  # the figures the table's profiles were built from
        self.job_ids: tuple[str, ...] = ()

    def profiles_for(self, running: list[JobState]) -> WorkerTable:
        """Every worker's profile for the running jobs (the first job's figures are its defaults)."""
        rows = self._figures(running)
        job_ids = tuple(j.spec.job_id for j in running)
        if self.rows is None or job_ids != self.job_ids:
            fleet = zip(self.workers, rows.tolist(), strict=True)
            self.table = WorkerTable(self._profile(w, row, job_ids) for w, row in fleet)
        else:
            changed = (rows != self.rows).any(axis=1)
            # a new price or liveness is looked at every step; other figures only when the step re-solves
            marked = (rows[:, :2] != self.rows[:, :2]).any(axis=1)
            for i, row in zip(np.flatnonzero(marked).tolist(), rows[marked].tolist(), strict=True):
                self.table.replace(i, self._profile(self.workers[i], row, job_ids))
            self.table.replace_later(np.flatnonzero(changed & ~marked).tolist(), self._current)
        self.rows, self.job_ids = rows, job_ids
        return self.table

    def _current(self, i: int) -> WorkerProfile:
        """Worker i's profile from the latest figures: those of the step that reads it."""
        return self._profile(self.workers[i], self.rows[i].tolist(), self.job_ids)

    def _figures(self, running: list[JobState]) -> np.ndarray:
        """One row per worker: alive, price, then μ, T_gen, T_bcast for each running job."""
        now, n = self.dissemination.clock.now, len(self.workers)
        alive = np.fromiter(map(attrgetter("alive"), self.workers), bool, n)
        dead = np.flatnonzero(~alive)
        silent = now - np.array([self.workers[i].last_hb for i in dead.tolist()], dtype=float)
        alive[dead[silent <= self.sc.dead_after_s]] = True  # the scheduler hears of a death by silence
        price = np.fromiter(map(attrgetter("price"), self.workers), float, n)
        columns = [alive, price]
        noise = self.sc.measure_noise
        if noise:
            self._measurement_errors()
        for job in running:
            t_gen = self.t_gen_ref * job.spec.gen_scale
            mu = self.concurrency / t_gen
            # the scheduler keeps the last measurement of T_bcast; until there is one it estimates
            seen = job.bcast_seen
            t_bcast = np.where(np.isnan(seen), self._estimates(job), seen)
            if noise:
                mu = mu * np.maximum(0.5, 1 + self.errors[:, 0])
                t_bcast = t_bcast * np.maximum(0.5, 1 + self.errors[:, 1])
            columns += [mu, t_gen, t_bcast]
        return np.column_stack(columns)

    def _estimates(self, job: JobState) -> np.ndarray:
        """Every worker's T_bcast estimate for the job; they move only when a publication moves the hint."""
        hint = (job.hint_rate, job.hint_depth)
        made = self.estimates.get(job.spec.job_id)
        if made is None or made[0] != hint:
            made = self.estimates[job.spec.job_id] = (hint, self.dissemination.estimate_bcast(self.down, job))
        return made[1]

    def _measurement_errors(self) -> None:
        """Relative errors of the scheduler's smoothed measurements (μ, T_bcast) per worker: they
        wander (an AR(1) process with a 5-minute correlation time), spread `measure_noise`; drawn
        worker by worker from the world's one random stream."""
        sigma = self.sc.measure_noise
        n = len(self.workers)
        if self.errors is None:
            self.errors = np.array([self.rng.gauss(0, sigma) for _ in range(2 * n)]).reshape(n, 2)
            return
        rho = math.exp(-self.sc.tick_s / 300.0)
        kick = sigma * math.sqrt(1 - rho * rho)
        self.errors = rho * self.errors + np.array([self.rng.gauss(0, kick) for _ in range(2 * n)]).reshape(n, 2)

    @staticmethod
    def _profile(w: WorkerState, row: list[float], job_ids: tuple[str, ...]) -> WorkerProfile:
        alive, price, *figures = row
        perfs = {job_id: WorkerPerf(*figures[3 * k : 3 * k + 3]) for k, job_id in enumerate(job_ids)}
        first = perfs[job_ids[0]]
        return WorkerProfile(
            worker_id=w.spec.worker_id,
            price_per_h=price,
            vram_gb=w.spec.vram_gb,
            backends=frozenset((w.spec.backend,)),
            mu=first.mu,
            t_gen_s=first.t_gen_s,
            t_bcast_s=first.t_bcast_s,
            alive=bool(alive),
            perf_by_job=perfs if len(job_ids) > 1 else {},
        )
