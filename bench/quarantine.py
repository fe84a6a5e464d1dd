"""How many of its groups a cheater sends before it is quarantined, under the control plane's trust rules.

    python bench/quarantine.py                          # catch rates of the replay run in docs/RELIABILITY.md
    python bench/quarantine.py --replay replay.json     # catch rates of `bench/replay.py --out replay.json`

Each trial is one worker of a provider of its own, taken through api/services/trust.py itself on a SQLite
database: `should_audit` picks which of its groups are audited (probation and suspect: all; trusted: one in
each window of 10, at its secret place), `passed` and `strike` move its state. An audited group of a cheat
fails with the probability bench/replay.py measured for that cheat (the share of all its groups the replay
caught; a group that is token for token an honest draw passes, as it does there). A copied group is flagged
at the door (api/services/admission.duplicated) and audited whatever the worker's trust.

Two ways to cheat: from the worker's first group (on probation), and after earning trust honestly (its
`probation_audits` groups passed, then every group a cheat), counted from its first cheating group.

What the figures leave out, each making them an upper bound: the sequential tests and the fleet comparison
(api/services/evidence.py), which strike some cheats sooner. And one way the stream runs longer: a verdict
is taken here as the group is sent, where in a job it comes when the learner claims the group, so a worker
sends the groups in flight meanwhile (on probation or suspect, at most 8 waiting for their verdict).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# `python bench/replay.py` of 2026-11-27 (docs/RELIABILITY.md, "Replay figures"): the share of each cheat's
# 1,000 groups (per backend; both backends alike) the replay audit caught.
CAUGHT = {"stale": 0.614, "stale3": 0.764, "nearby-1": 0.049, "nearby-5": 0.260, "copy": 1.0, "eos": 1.0,
          "pick": 0.321}
DOOR_FLAGGED = {"copy"}
WITHIN = 20  # issue 27: quarantined within 20 of its groups


def caught_rates(path: Path | None) -> dict[str, float]:
    if path is None:
        return CAUGHT
    cheats = json.loads(path.read_text())["cheats"]
    rates: dict[str, list[float]] = {}
    for name, c in cheats.items():  # "stale (transformers)": both backends pooled
        rates.setdefault(name.split(" ")[0], []).append(c["caught"] / c["groups"])
    return {cheat: statistics.fmean(r) for cheat, r in rates.items()}


def groups_to_quarantine(db, settings, p: float, flagged: bool, honest_first: bool, rng: random.Random,
                         cap: int) -> int | None:  # type: ignore[no-untyped-def]
    """The cheating groups a fresh worker sends up to and including the one whose verdict quarantines it."""
    from echo2.protocol import TrustState

    from api.models import Provider, Rollout, Worker
    from api.services import trust

    provider = Provider(name="cheat")
    db.add(provider)
    db.flush()
    worker = Worker(provider_id=provider.id, name="cheat", gpu_model="sim", gpu_count=1, vram_gb=24.0,
                    price_per_hour=0.1, region="sim", upload_mbps=100.0, download_mbps=100.0, backends=[],
                    software="sim", stats={}, trust=TrustState.probation)
    db.add(worker)
    db.flush()
    seq = 0
    while honest_first and worker.trust is TrustState.probation:
        if trust.should_audit(worker, Rollout(seq=seq), settings):
            trust.passed(db, worker, settings)
        seq += 1
    for sent in range(1, cap + 1):
        group = Rollout(seq=seq, suspicion="duplicated samples" if flagged else None)
        seq += 1
        if trust.should_audit(worker, group, settings):
            if rng.random() < p:
                trust.strike(db, worker, "replay: cheat", settings, audited=True)
            else:
                trust.passed(db, worker, settings)
        if not worker.trust.can_work():
            return sent
    return None


def run(rates: dict[str, float], trials: int, cap: int, seed: int) -> list[dict[str, object]]:
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from api.models import Base
    from api.settings import Settings

    rows = []
    with tempfile.TemporaryDirectory(prefix="echo2-quarantine-") as tmp:
        settings = Settings(data_dir=Path(tmp))
        engine = create_engine("sqlite://")
        Base.metadata.create_all(engine)
        for cheat, p in rates.items():
            for honest_first in (False, True):
                rng = random.Random(f"{seed}:{cheat}:{honest_first}")
                counts = []
                with Session(engine) as db:
                    for _ in range(trials):
                        counts.append(groups_to_quarantine(db, settings, p, cheat in DOOR_FLAGGED, honest_first,
                                                           rng, cap))
                    db.rollback()
                rows.append(_summary(cheat, p, honest_first, counts, cap))
    return rows


def _summary(cheat: str, p: float, honest_first: bool, counts: list[int | None], cap: int) -> dict[str, object]:
    done = sorted(c for c in counts if c is not None)

    def at(q: float) -> int | None:
        """The q-quantile of all trials, those not quarantined by the cap the longest (None: beyond it)."""
        i = int(q * len(counts))
        return done[i] if i < len(done) else None

    return {"cheat": cheat, "caught_per_group": p, "start": "after trust" if honest_first else "from its first group",
            "trials": len(counts), "within_20": sum(c <= WITHIN for c in done) / len(counts),
            "median": at(0.5), "p90": at(0.9), "p99": at(0.99), "not_by_cap": len(counts) - len(done), "cap": cap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replay", type=Path, help="a `bench/replay.py --out` report to take the catch rates from")
    parser.add_argument("--trials", type=int, default=2000, help="cheating workers per cheat and start")
    parser.add_argument("--cap", type=int, default=5000, help="groups a trial may send before it is given up")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    rows = run(caught_rates(args.replay), args.trials, args.cap, args.seed)
    print("| cheat | caught per group | cheats | workers | quarantined within 20 groups | median | 90th | 99th "
          "| not by the cap |")
    print("| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        cells = [str(r[k]) if r[k] is not None else f"> {r['cap']}" for k in ("median", "p90", "p99")]
        print(f"| {r['cheat']} | {100 * r['caught_per_group']:.1f} % | {r['start']} | {r['trials']:,} | "
              f"{100 * r['within_20']:.1f} % | {' | '.join(cells)} | {r['not_by_cap']} |")
    print(f"quarantine: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
