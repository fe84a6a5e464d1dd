"""The capacity rule's freshness condition for a 1B-shaped model at 100 Mbit/s, with each form of a
version: who qualifies when versions ship whole in bf16, as deltas, or as a LoRA adapter.

    python bench/freshness_bytes.py --delta-share 0.012      # the share measured by bench/weight_bytes.py

A computation with stated inputs, through the scheduler's own code (`planner.capacity.qualify` and
`estimate_bcast_s`), not a measurement. Model: the Llama-3.2-1B shape (1.236 B parameters; hidden 2048,
16 layers, 8 KV heads of 64): 2.47 GB in bf16. A LoRA r = 16 adapter on q/k/v/o is 3.41 M parameters,
6.8 MB in bf16. The delta is `--delta-share` of the full bf16 version (bench/weight_bytes.py measured it
on SmolLM2-135M; docs/BENCHMARKS.md). Job: S = 2, κ = 1, T_train = 30 s per step, so a worker must hold
a version and generate a group within (S − κ + 1)·T_train = 60 s. Worker: a home GPU with a 100 Mbit/s
downlink, fed directly by a relay parent with more uplink than that (depth 1, 8 MiB chunks, 50 ms per
hop), T_gen = 15 s per group.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PARAMS_1B = 1_235_814_400
ADAPTER_PARAMS = 16 * 16 * ((2048 + 2048) * 2 + (2048 + 512) * 2)  # layers × r × (q, o: 2048→2048; k, v: 2048→512)
DOWN_BPS = 100e6 / 8
T_TRAIN_S, T_GEN_S = 30.0, 15.0


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--delta-share", type=float, required=True, help="delta bytes / full bf16 bytes")
    share = args.parse_args().delta_share
    from planner.capacity import JobProfile, WorkerPerf, WorkerProfile, estimate_bcast_s, qualify

    full = 2 * PARAMS_1B
    job = JobProfile(job_id="1b", rollouts_per_step=64, t_train_s=T_TRAIN_S, staleness=2, publish_period=1)
    print(f"1B-shaped model, {full / 1e9:.2f} GB in bf16; S=2, κ=1, T_train {T_TRAIN_S:.0f} s; worker at 100 Mbit/s, "
          f"T_gen {T_GEN_S:.0f} s")
    print(f"{'version form':<32} {'bytes':>10} {'T_bcast':>9}  verdict")
    for name, size in (("full bf16", full), (f"delta bf16 ({share:.2%} of full)", share * full),
                       ("LoRA r=16 adapter (q,k,v,o)", 2 * ADAPTER_PARAMS)):
        t_bcast = estimate_bcast_s(size, DOWN_BPS, 10 * DOWN_BPS, depth=1, chunk_bytes=8 * 2**20, hop_latency_s=0.05)
        worker = WorkerProfile(worker_id="home", price_per_h=0.2, vram_gb=24, backends=frozenset({"vllm"}),
                               mu=1 / T_GEN_S, t_gen_s=T_GEN_S, t_bcast_s=t_bcast,
                               perf_by_job={"1b": WorkerPerf(1 / T_GEN_S, T_GEN_S, t_bcast)})
        q = qualify(worker, job)
        print(f"{name:<32} {size / 1e6:>7.1f} MB {t_bcast:>8.1f}s  {'qualifies' if q.ok else 'excluded'}: {q.reason}")


if __name__ == "__main__":
    main()
