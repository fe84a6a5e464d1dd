"""Evidence that accumulates: what no single audit shows about a worker, seen over many of its groups.

1. Sequential tests over a worker's audits (CUSUM, kept in `Worker.evidence`), so a worker that cheats a
   little in every group is caught as surely as one that cheats a lot once:
   - the likelihood z of each audited group (learner/audit.py; about N(0, 1) for an honest group), two-sided:
     C± = max(0, C± ± z - Z_K), an alarm at C± > Z_H. A worker whose tokens are consistently a little too
     likely (picked) or too unlikely (hotter, noisier) drifts to it; one honest group at |z| = 5 does not;
   - near ties of the replay (tokens the replay did not draw, closer than the margin: numerics, or a model
     a little off), per replayed token of a float32 worker, against the honest rate TIE_P0: a Bernoulli CUSUM
     of log-likelihood ratio against TIE_P1, an alarm at TIE_H. (A bfloat16 worker's near ties are common and
     honest; its test is the replay's hard mismatches.)
   An alarm is a strike with the statistics in its reason, and the test starts over.
2. Fleet comparisons of what the replay cannot judge: each worker's trained groups against the rest of the
   job's over the last FLEET_WINDOW trained groups, by their reward, their length and how often their samples
   repeat, each as its difference from the mean of the groups of the same version (a slow worker's groups are
   older, and may be worse for that alone). In the direction a cheat moves them (rewards lower: picked worst
   samples; lengths shorter: cut short; repeats more often: copied), a Welch z beyond FLEET_Z, with at least
   FLEET_MIN_GROUPS groups on each side, makes the worker a suspect (every group audited, its reason says
   why): a statistic points, the replay proves. Prompts someone handed back are left out, and a worker is judged
   against the others' fair draws only (`_drawn`): one that hands back the prompts it finds hard chose what it
   sent, and gave the others what it left. It costs an honest worker audits, never money. (Directional, so that
   beside one bad worker the good ones, above the rest, are not flagged too.)

False-alarm rates of both, measured on honest fleets, are in docs/RELIABILITY.md ("Evidence").
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from echo2.protocol import Precision, RolloutStatus, TrustState
from sqlalchemy import Row, func, select
from sqlalchemy.orm import Session

from ..models import Lease, Prompt, Rollout, Worker
from ..settings import Settings
from . import trust

Z_K, Z_H = 1.0, 10.0  # CUSUM allowance and alarm threshold on per-group z (ARL0 ~ 1e9 audits, ARL1 ~ 11 at |z|=2)
TIE_P0, TIE_P1, TIE_H = 1e-4, 1e-2, 25.0  # near-tie rate per replayed fp32 token: honest, cheating; alarm
FLEET_WINDOW, FLEET_MIN_GROUPS, FLEET_Z, FLEET_EVERY = 2000, 30, 5.0, 10


def record(db: Session, worker: Worker, stats: dict[str, float], precision: str | None, settings: Settings) -> None:
    """Add one audit's statistics to the worker's sequential tests; strike it on an alarm."""
    ev = dict(worker.evidence or {})
    z = float(stats.get("z", 0.0))
    if not math.isfinite(z):
        return  # a failed audit already struck it
    if not _replayed_exactly(stats):  # else its z tests nothing the replay did not settle (learner/audit.py)
        ev["z_hi"] = max(0.0, ev.get("z_hi", 0.0) + z - Z_K)
        ev["z_lo"] = max(0.0, ev.get("z_lo", 0.0) - z - Z_K)
    if (precision or Precision.float32) == Precision.float32 and stats.get("replayed"):
        ev["ties"] = max(0.0, ev.get("ties", 0.0) + _tie_llr(stats.get("near_ties", 0.0), stats["replayed"]))
    ev["audits"] = ev.get("audits", 0) + 1
    alarm = _alarm(ev)
    worker.evidence = ev
    if alarm:
        worker.evidence = {}  # the test starts over
        trust.strike(db, worker, f"sequential test over its last {ev['audits']} audits: {alarm}", settings)


def _replayed_exactly(stats: dict[str, float]) -> bool:
    """Every token of the audited group is the sampler's own draw with its leased seed, no near tie: at a low
    temperature its z, a sum of a few lopsided terms, is far from normal (an honest group gave z = -21)."""
    return stats.get("replayed", 0.0) == stats.get("tokens", -1.0) and not stats.get("near_ties") \
        and not stats.get("mismatches")


def _tie_llr(ties: float, tokens: float) -> float:
    """log P(ties | p1) / P(ties | p0) for `ties` near ties among `tokens` replayed tokens."""
    return ties * math.log(TIE_P1 / TIE_P0) + (tokens - ties) * math.log((1 - TIE_P1) / (1 - TIE_P0))


def _alarm(ev: dict[str, float]) -> str | None:
    if ev.get("z_hi", 0.0) > Z_H:
        return f"its tokens are consistently more likely than sampling makes them (CUSUM {ev['z_hi']:.1f} > {Z_H:g})"
    if ev.get("z_lo", 0.0) > Z_H:
        return f"its tokens are consistently less likely than sampling makes them (CUSUM {ev['z_lo']:.1f} > {Z_H:g})"
    if ev.get("ties", 0.0) > TIE_H:
        return (f"the replay finds near ties at far more than an honest float32 worker's rate (log-likelihood "
                f"ratio {ev['ties']:.1f} > {TIE_H:g})")
    return None


def compare_fleet(db: Session, job_id: str, step: int) -> list[str]:
    """Every FLEET_EVERY steps: workers whose trained groups differ from the rest of the job's (module docstring)
    become suspects. Returns their ids."""
    if step % FLEET_EVERY:
        return []
    rows = db.execute(
        select(Rollout.worker_id, Rollout.version, Rollout.rewards, Rollout.samples, Rollout.suspicion,
               Rollout.lease_id, Rollout.prompt_id)
        .where(Rollout.job_id == job_id, Rollout.status == RolloutStatus.trained)
        .order_by(Rollout.trained_step.desc(), Rollout.id).limit(FLEET_WINDOW)).all()
    rows, fair = _drawn(db, rows)
    measures = {("reward", -1): [_mean(r.rewards) for r in rows],
                ("length", -1): [_mean(len(s["token_ids"]) for s in r.samples) for r in rows],
                ("repeats", 1): [float(r.suspicion is not None) for r in rows]}
    flagged = []
    for worker_id, why in _outliers([r.worker_id for r in rows], [r.version for r in rows], measures, fair).items():
        worker = db.get(Worker, worker_id, with_for_update=True)
        if worker is not None and worker.trust in (TrustState.trusted, TrustState.probation):
            worker.trust, worker.trust_reason = TrustState.suspect, f"fleet comparison on job {job_id}: {why}"[:512]
            flagged.append(worker_id)
    return flagged


def _drawn(db: Session, rows: Sequence[Row[Any]]) -> tuple[list[Row[Any]], list[bool]]:
    """The groups of prompts the server drew for their lease, none handed back (a prompt another worker released
    went to whoever leased next: the releaser chose it for them), and whether each is a fair draw: sent on a lease
    that got a group for every prompt it held. A worker is judged on all its groups, against the fair draws of the
    others: one that sends the prompts it finds easy and releases the rest chose what it sent, so it is no yardstick
    for an honest one (whom it would frame), and releasing a prompt of each lease does not hide its own groups."""
    returned = set(db.scalars(select(Prompt.id).where(Prompt.id.in_({r.prompt_id for r in rows}),
                                                      Prompt.attempts > 0)))
    rows = [r for r in rows if r.prompt_id not in returned]
    leases = {r.lease_id for r in rows}
    held = {i: ids for i, ids in db.execute(select(Lease.id, Lease.prompt_ids).where(Lease.id.in_(leases)))}
    sent = {i: n for i, n in db.execute(select(Rollout.lease_id, func.count()).where(Rollout.lease_id.in_(leases))
                                        .group_by(Rollout.lease_id))}
    return rows, [sent.get(r.lease_id, 0) >= len(held[r.lease_id]) for r in rows]


def _outliers(workers: list[str], versions: list[int], measures: dict[tuple[str, int], list[float | None]],
              fair: list[bool] | None = None) -> dict[str, str]:
    """worker -> why, for the workers whose groups' residuals (value - mean of their version) stand out in the
    direction (+1 above, -1 below) of each measure, against the others' `fair` groups (all, when not given)."""
    out: dict[str, str] = {}
    fair = fair if fair is not None else [True] * len(workers)
    for (name, direction), values in measures.items():
        residual = _residuals(versions, values)
        by_worker: dict[str, list[float]] = defaultdict(list)
        yardstick: dict[str, list[float]] = defaultdict(list)
        for w, r, f in zip(workers, residual, fair, strict=True):
            if r is not None:
                by_worker[w].append(r)
                if f:
                    yardstick[w].append(r)
        for w, mine in by_worker.items():
            rest = [r for other, rs in yardstick.items() if other != w for r in rs]
            z = _welch(mine, rest)
            if z is not None and z * direction > FLEET_Z and w not in out:
                out[w] = (f"its groups' {name} is {abs(z):.1f} standard errors {'above' if z > 0 else 'below'} the "
                          f"rest of the fleet's over {len(mine)} and {len(rest)} groups")
    return out


def _residuals(versions: list[int], values: list[float | None]) -> list[float | None]:
    by_version: dict[int, list[float]] = defaultdict(list)
    for v, x in zip(versions, values, strict=True):
        if x is not None:
            by_version[v].append(x)
    means = {v: statistics.fmean(xs) for v, xs in by_version.items()}
    return [None if x is None else x - means[v] for v, x in zip(versions, values, strict=True)]


def _welch(a: list[float], b: list[float]) -> float | None:
    if len(a) < FLEET_MIN_GROUPS or len(b) < FLEET_MIN_GROUPS:
        return None
    var = statistics.variance(a) / len(a) + statistics.variance(b) / len(b)
    diff = statistics.fmean(a) - statistics.fmean(b)
    if var <= 0:
        return None if diff == 0 else math.copysign(math.inf, diff)
    return diff / math.sqrt(var)


def _mean(values: Iterable[float | None] | None) -> float | None:
    xs = [x for x in values or () if x is not None]
    return statistics.fmean(xs) if xs else None
