"""Database size per million trained samples, with every group's tokens in the table and after the rollout
archive has taken them (api/services/archive.py).

    python bench/db_size.py --db both

For each database (a SQLite file; a private PostgreSQL cluster on loopback) this migrates a fresh database,
then writes, through the real models, a job's trained steps as admission, the learner's step commit and
billing leave them: per step, `--groups` prompts leased 8 at a time, a group per prompt of G samples of
`--new-tokens` tokens after a `--prompt-tokens` prompt, each token with the worker's behaviour logprob (a
float32 value written as a JSON float, as a worker sends it) and the learner's own (rounded to 4 digits, as
learner/traces.py stores it), the rewards, the step's metrics (naming its groups) and a ledger entry paying
for them. Token ids are uniform over a 49,152 vocabulary (SmolLM2's), so they compress worse than real
text's. It measures the database empty, filled, and after `archive.sweep` moved every group's tokens out
(the job ended; a running job keeps its newest 2,000 trained groups or last 20 steps in the table, and up to
a file's worth waiting: a constant per job, printed last), each after a full vacuum (SQLite: VACUUM, the
file's size, and `dbstat` pages of `rollouts` and its indexes; PostgreSQL: VACUUM FULL, pg_database_size,
and pg_total_relation_size of `rollouts` with its TOAST and indexes): what the same data occupies once the
space archiving freed is reused. Prints bytes per group, then per million trained samples (scaled), for the
database and for the archive files.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 49_152
AFTER_STEPS = 20  # ECHO2_ARCHIVE_AFTER_STEPS's default
LEASE_PROMPTS = 8


@contextmanager
def database(kind: str, root: Path) -> Iterator[str]:
    """A fresh, migrated database of this kind; yields its URL."""
    from api.migrate import upgrade
    from server.local import PostgresServer

    if kind == "sqlite":
        url = f"sqlite:///{root / 'echo2.db'}"
        upgrade(url)
        yield url
        return
    with PostgresServer() as server:
        upgrade(server.url)
        yield server.url


def measure(db, kind: str) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(database bytes, rollouts table bytes with its indexes) after a full vacuum."""
    from sqlalchemy import text

    db.engine.dispose()
    if kind == "sqlite":  # the driver's own connection: the engine opens a transaction, where VACUUM cannot run
        import sqlite3

        with sqlite3.connect(db.url.removeprefix("sqlite:///"), isolation_level=None) as conn:
            conn.execute("VACUUM")
            total = conn.execute("PRAGMA page_size").fetchone()[0] * conn.execute("PRAGMA page_count").fetchone()[0]
            table = conn.execute("SELECT SUM(pgsize) FROM dbstat WHERE name = 'rollouts' "
                                 "OR name LIKE 'sqlite_autoindex_rollouts%' OR name LIKE 'ix_rollouts%'").fetchone()[0]
        return total, int(table or 0)
    with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM FULL"))
        return (conn.execute(text("SELECT pg_database_size(current_database())")).scalar_one(),
                conn.execute(text("SELECT pg_total_relation_size('rollouts')")).scalar_one())


def _floats(rng: random.Random, n: int) -> list[float]:
    """Logprobs as a sampler's float32 values read back as Python floats (their JSON is as long as a real one's)."""
    import numpy as np

    return np.float32([-rng.expovariate(2.0) for _ in range(n)]).tolist()


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _sample(rng: random.Random, new_tokens: int) -> dict:
    from echo2.protocol import SampleSubmit

    sample = SampleSubmit(token_ids=_tokens(rng, new_tokens), logprobs=_floats(rng, new_tokens),
                          finish_reason="length")
    return sample.model_dump(mode="json", exclude={"text"})  # as admission stores it


def fill(db, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    """Write the job's trained steps (module docstring)."""
    from echo2.protocol import JobSpec
    from sqlalchemy import insert

    from api.models import Job, Lease, LedgerEntry, Prompt, Provider, Rollout, StepMetric, User, Worker, utcnow

    rng, now = random.Random(0), utcnow()
    spec = JobSpec.model_validate({"name": "db-size", "base_model": "echo2:tiny", "task": {"name": "arithmetic"},
                                   "grpo": {"group_size": args.group_size, "prompts_per_step": args.groups,
                                            "max_new_tokens": args.new_tokens}, "max_steps": args.steps})
    with db.session() as s:
        user, provider = User(name="bench", role="user"), Provider(name="bench")
        s.add_all([user, provider])
        s.flush()
        worker = Worker(provider_id=provider.id, name="w", gpu_model="H100", gpu_count=1, vram_gb=80,
                        price_per_hour=2.0, region="eu", upload_mbps=100, download_mbps=100, backends=["vllm"],
                        software="echo2-worker", trust="trusted")
        job = Job(owner_id=user.id, name="db-size", spec=spec.model_dump(mode="json"), status="succeeded",
                  step=args.steps, version=args.steps, final_version=args.steps, num_prompts=args.steps * args.groups,
                  started_at=now - timedelta(days=2), finished_at=now - timedelta(days=1))
        s.add_all([worker, job])
        s.commit()
        for step in range(args.steps):
            leases, prompts, rollouts = _step(rng, args, job.id, worker.id, step)
            s.execute(insert(Lease), leases)
            s.execute(insert(Prompt), prompts)
            s.execute(insert(Rollout), rollouts)
            ids = [r["id"] for r in rollouts]
            entry = LedgerEntry(job_id=job.id, kind="worker", worker_id=worker.id, provider_id=provider.id,
                                amount_usd=0.01, seconds=10.0, groups=len(ids), rollout_ids=ids, step=step,
                                memo=f"{len(ids)} groups trained (job step {step})")
            s.add(entry)
            s.flush()
            s.execute(Rollout.__table__.update().where(Rollout.id.in_(ids)).values(paid_entry_id=entry.id))
            s.add(StepMetric(job_id=job.id, step=step, t_train_s=2.0, reward_mean=0.5, reward_std=0.5, loss=0.1,
                             kl=0.0, clip_frac=0.0, groups=len(ids), groups_dropped=0, rollout_ids=ids,
                             staleness_hist=[len(ids)], tokens=len(ids) * args.group_size * args.new_tokens))
            s.commit()


def _step(rng: random.Random, args: argparse.Namespace, job_id: str, worker_id: str,
          step: int) -> tuple[list[dict], list[dict], list[dict]]:
    """One step's leases, prompts and trained groups, as rows."""
    from api.models import new_id, utcnow

    now, first = utcnow(), step * args.groups
    leases, prompts, rollouts = [], [], []
    for start in range(first, first + args.groups, LEASE_PROMPTS):
        lease = {"id": new_id("lse"), "job_id": job_id, "worker_id": worker_id, "status": "completed",
                 "version": step, "step_at_lease": step, "expires_at": now, "finished_at": now,
                 "prompt_ids": [p + 1 for p in range(start, min(start + LEASE_PROMPTS, first + args.groups))]}
        leases.append(lease)
        for p in lease["prompt_ids"]:
            prompts.append({"id": p, "job_id": job_id, "index": p, "text": f"{p % 90 + 10}+{p % 7}=",
                            "reference": str(p % 90 + 10 + p % 7), "state": "trained",
                            "order_key": rng.getrandbits(62), "lease_id": lease["id"]})
            samples = [_sample(rng, args.new_tokens) for _ in range(args.group_size)]
            rollouts.append({
                "id": new_id("rol"), "job_id": job_id, "prompt_id": p, "lease_id": lease["id"],
                "worker_id": worker_id, "version": step, "status": "trained", "reason": None,
                "prompt_token_ids": _tokens(rng, args.prompt_tokens), "samples": samples,
                "rewards": [float(rng.random() < 0.5) for _ in samples],
                # rounded as learner/traces.py stores them
                "learner_logprobs": [[round(v, 4) for v in _floats(rng, args.new_tokens)] for _ in samples],
                "gen_seconds": 1.5, "seq": p, "seed": rng.getrandbits(62), "precision": "bfloat16",
                "claim_step": None, "trained_step": step, "created_at": now})
    return leases, prompts, rollouts


def run(kind: str, args: argparse.Namespace) -> dict[str, float]:
    from api.db import Database
    from api.services import archive

    root = Path(tempfile.mkdtemp(prefix="echo2-dbsize-"))
    try:
        with database(kind, root) as url:
            db = Database(url)
            empty, _ = measure(db, kind)
            t0 = time.perf_counter()
            fill(db, args)
            filled_s = time.perf_counter() - t0
            hot, hot_table = measure(db, kind)
            t0 = time.perf_counter()
            with db.session() as s:
                moved = archive.sweep(s, root, 0.0, AFTER_STEPS)
            archive_s = time.perf_counter() - t0
            archived, archived_table = measure(db, kind)
            files = sum(p.stat().st_size for p in archive.archive_dir(root).rglob("*.parquet"))
            db.dispose()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    groups = args.steps * args.groups
    assert sum(moved.values()) == groups, moved
    return {"groups": groups, "fill_s": filled_s, "archive_s": archive_s,
            "hot_db": (hot - empty) / groups, "hot_table": hot_table / groups,
            "archived_db": (archived - empty) / groups, "archived_table": archived_table / groups,
            "files": files / groups}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both")
    p.add_argument("--steps", type=int, default=160, help="trained steps (default 160)")
    p.add_argument("--groups", type=int, default=64, help="groups per step (default 64: the demo's)")
    p.add_argument("--group-size", type=int, default=8, help="G, samples per group (default 8)")
    p.add_argument("--prompt-tokens", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per sample (default 64)")
    args = p.parse_args()
    from api.services import archive, evidence

    kinds = ["sqlite", "postgres"] if args.db == "both" else [args.db]
    per_million = 1e6 / args.group_size  # groups in a million samples
    print(f"{args.steps} steps x {args.groups} groups of G={args.group_size}, prompt {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens per sample")
    print(f"{'database':<9} {'fill s':>7} {'archive s':>9} | {'bytes/group: db':>15} {'rollouts':>9} | "
          f"{'archived: db':>12} {'rollouts':>9} {'files':>7} | {'GB/1M samples: hot db':>21} "
          f"{'archived db':>11} {'files':>6}")
    for kind in kinds:
        r = run(kind, args)
        print(f"{kind:<9} {r['fill_s']:>7.1f} {r['archive_s']:>9.1f} | {r['hot_db']:>15,.0f} {r['hot_table']:>9,.0f} | "
              f"{r['archived_db']:>12,.0f} {r['archived_table']:>9,.0f} {r['files']:>7,.0f} | "
              f"{r['hot_db'] * per_million / 1e9:>21.2f} {r['archived_db'] * per_million / 1e9:>11.3f} "
              f"{r['files'] * per_million / 1e9:>6.2f}")
        kept = max(evidence.FLEET_WINDOW, AFTER_STEPS * args.groups) + archive.GROUPS_PER_FILE - 1
        print(f"{'':<9} a running job keeps at most {kept:,} groups' tokens in the table: "
              f"{kept * r['hot_table'] / 1e6:,.0f} MB at this shape")


if __name__ == "__main__":
    main()
