"""Cost of one training job under four activation policies, measured side by side in one run.

    python bench/sim_cost.py [--scenario planner/sim/scenarios/hetero_1000.toml] [--json]

Same job, same learner (reserved cluster), same learner-throughput target R / T_train:
  (a) co-located baseline: rollouts also generated on reserved premium GPUs inside the learner's
      cluster, as many as the capacity rule needs (⌈(1+h)·R/T_train / μ⌉), always on;
  (b) activate-all: every worker of the heterogeneous pool that can run the model;
  (c) greedy by price/μ over the pool (capacity rule + hysteresis);
  (d) MILP over the pool (capacity rule + hysteresis).
Cost = learner reserved price × wall + Σ worker price × active time, from the simulator.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.capacity import required_throughput  # noqa: E402
from planner.sim import Scenario, SimResult, WorkerType, load_scenario, simulate  # noqa: E402

# (a): reserved H100 inside the learner's cluster: same price per GPU-hour as the learner's
# GPUs, same generation speed as a marketplace H100, NVLink/InfiniBand-class links.
PREMIUM = WorkerType(
    name="h100-reserved",
    count=0,
    price_per_h=2.20,
    vram_gb=80,
    backend="vllm",
    concurrency=16,
    t_gen_s=16,
    down_mbps=(100_000, 100_000),
    up_mbps=(100_000, 100_000),
)


def colocated(sc: Scenario) -> Scenario:
    job = sc.jobs[0]
    mu = PREMIUM.concurrency / (PREMIUM.t_gen_s * job.gen_scale)
    count = math.ceil(required_throughput(job.profile()) / mu)
    return dataclasses.replace(
        sc,
        name=f"{sc.name} co-located",
        worker_types=(dataclasses.replace(PREMIUM, count=count, backend=job.backends[0] if job.backends else "vllm"),),
        relay=dataclasses.replace(sc.relay, origin_up_mbps=100_000, topology="tree"),
        solver=dataclasses.replace(sc.solver, method="all"),
        events=(),
    )


def with_method(sc: Scenario, method: str) -> Scenario:
    return dataclasses.replace(sc, solver=dataclasses.replace(sc.solver, method=method))


def price_table(sc: Scenario) -> list[dict]:
    rows = []
    for wt in (*sc.worker_types, PREMIUM):
        mu = wt.concurrency / wt.t_gen_s
        rows.append(
            {
                "type": wt.name,
                "count": wt.count if wt is not PREMIUM else "as needed",
                "price_per_h": wt.price_per_h,
                "mu": round(mu, 3),
                "usd_per_h_per_rollout_s": round(wt.price_per_h / mu, 3),
                "vram_gb": wt.vram_gb,
                "down_mbps": list(wt.down_mbps),
                "up_mbps": list(wt.up_mbps),
            }
        )
    return rows


def row(label: str, r: SimResult) -> dict:
    j = r.jobs[0]
    return {
        "policy": label,
        "completed": j.completed,
        "steps": j.steps,
        "peak_workers": j.peak_active,
        "worker_hours": round(r.worker_hours, 2),
        "wall_h": round(j.wall_s / 3600, 3),
        "utilisation": round(j.utilisation, 4),
        "dropped_stale": j.dropped_stale,
        "prompts_lost": r.prompts_lost,
        "learner_usd": round(r.cost_learner, 2),
        "workers_usd": round(r.cost_workers, 2),
        "fleet_usd_per_h": round(r.cost_workers / (j.wall_s / 3600), 4) if j.wall_s else 0.0,
        "total_usd": round(r.cost_total, 4),
        "sim_runtime_s": round(r.runtime_s, 2),
        "sim_cpu_s": round(r.cpu_s, 2),
        "resolves": r.resolves,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default=str(ROOT / "planner/sim/scenarios/hetero_1000.toml"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    sc = load_scenario(args.scenario)
    runs = [
        ("(a) co-located premium", colocated(sc)),
        ("(b) activate-all", with_method(sc, "all")),
        ("(c) greedy", with_method(sc, "greedy")),
        ("(d) MILP", with_method(sc, "milp")),
    ]
    rows = [row(label, simulate(s)) for label, s in runs]
    base = rows[0]["total_usd"]
    for r in rows:
        r["vs_a"] = round(r["total_usd"] / base, 4)
    d, c = rows[3], rows[2]
    checks = {
        "d_saving_vs_a": round(1 - d["total_usd"] / base, 4),
        "d_at_least_33pct_cheaper_than_a": d["total_usd"] <= 0.67 * base,
        "d_le_c": d["total_usd"] <= c["total_usd"],
        "no_prompt_lost": all(r["prompts_lost"] == 0 for r in rows),
    }
    job = sc.jobs[0]
    target = required_throughput(job.profile())
    if args.json:
        print(json.dumps({"scenario": sc.name, "target_rollouts_per_s": target, "prices": price_table(sc),
                          "rows": rows, "checks": checks}, indent=2))  # fmt: skip
        return 0
    print(f"scenario {sc.name}: job {job.job_id}, R={job.rollouts_per_step}, T_train={job.t_train_s:g}s, "
          f"S={job.staleness}, κ={job.publish_period}, {job.max_steps} steps, model {job.model_gb:g} GB")  # fmt: skip
    print(f"learner ${job.learner_price_per_h:.2f}/h reserved; throughput target (1+h)R/T = {target:.2f} groups/s")
    print("\nprice table (μ in groups/s; bandwidth ranges in Mbit/s):")
    print(f"  {'type':<16}{'count':>10}{'$/h':>7}{'μ':>7}{'$/h per r/s':>13}{'VRAM':>6}  down / up")
    for p in price_table(sc):
        cells = f"{p['price_per_h']:>7.2f}{p['mu']:>7.3f}{p['usd_per_h_per_rollout_s']:>13.3f}{p['vram_gb']:>6g}"
        print(f"  {p['type']:<16}{p['count']!s:>10}{cells}  {p['down_mbps']} / {p['up_mbps']}")
    print(
        f"\n{'policy':<25}{'peak A':>7}{'wkr-h':>8}{'wall h':>8}{'util':>8}{'dropped':>8}{'lost':>5}"
        f"{'fleet $/h':>10}{'learner $':>10}{'workers $':>10}{'total $':>9}{'vs (a)':>8}{'sim s':>7}{'cpu s':>7}"
    )
    for r in rows:
        cells = (
            f"{r['peak_workers']:>7}{r['worker_hours']:>8.1f}{r['wall_h']:>8.3f}{r['utilisation']:>8.1%}"
            f"{r['dropped_stale']:>8}{r['prompts_lost']:>5}{r['fleet_usd_per_h']:>10.3f}{r['learner_usd']:>10.2f}"
            f"{r['workers_usd']:>10.2f}"
        )
        print(
            f"{r['policy']:<25}{cells}{r['total_usd']:>9.2f}{r['vs_a']:>8.3f}{r['sim_runtime_s']:>7.1f}{r['sim_cpu_s']:>7.1f}"
        )
    print(
        f"\n(d) saving vs (a): {checks['d_saving_vs_a']:.1%} (target ≥ 33%): "
        f"{'ok' if checks['d_at_least_33pct_cheaper_than_a'] else 'MISSED'}"
    )
    print(
        f"(d) ≤ (c): {'ok' if checks['d_le_c'] else 'MISSED'} "
        f"(${d['total_usd']:.3f} vs ${c['total_usd']:.3f}); prompts lost: "
        f"{sum(r['prompts_lost'] for r in rows)}"
    )
    return 0 if all(v for v in checks.values() if isinstance(v, bool)) else 1


if __name__ == "__main__":
    sys.exit(main())
