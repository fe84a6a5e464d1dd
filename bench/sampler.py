"""One decode step's draw: the replayable sampler (`echo2.sampler.draw`, one batched draw for every row) against
the per-row draw it replaced in the worker's transformers backend (a seeded `torch.Generator` and
`torch.multinomial` per row), on the same logits, side by side in one run.

    python bench/sampler.py                   # 64 rows x SmolLM2's 49,152-token vocabulary, 5 rounds
    python bench/sampler.py --rows 512 --vocab 152064 --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49_152)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    import torch
    from echo2.sampler import RowSettings, draw

    device = torch.device(args.device)
    logits = torch.randn(args.rows, args.vocab, device=device) * 3
    settings = RowSettings.of([(1.0, 0, 1.0)] * args.rows, device)
    seeds = torch.arange(args.rows, device=device)
    positions = torch.zeros(args.rows, dtype=torch.int64, device=device)
    generators = [torch.Generator(device=device).manual_seed(i) for i in range(args.rows)]

    def replayable() -> None:
        draw(logits, settings, seeds, positions)

    def per_row() -> None:
        logp = torch.log_softmax(logits, dim=-1)
        picked = torch.cat([torch.multinomial(logp[b].exp(), 1, generator=g) for b, g in enumerate(generators)])
        logp.gather(-1, picked.unsqueeze(-1))

    times: dict[str, list[float]] = {"replayable": [], "per-row": []}
    for _ in range(args.rounds):  # alternating, so foreign load falls on both sides alike
        for name, fn in (("replayable", replayable), ("per-row", per_row)):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    a, b = statistics.median(times["replayable"]), statistics.median(times["per-row"])
    print(f"{args.rows} rows x {args.vocab:,} tokens on {device}, median of {args.rounds}: replayable draw "
          f"{a * 1000:.1f} ms, per-row multinomial {b * 1000:.1f} ms; ratio {b / a:.1f}x")


if __name__ == "__main__":
    main()
