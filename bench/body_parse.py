"""A worker's rollout submission body read both ways, in one process, on the same bytes: FastAPI's own (`json.loads`,
then the body's model validates the Python objects, as `fastapi.routing` does) and the API's route class
(api/routing.py::ModelBody: the model validates the bytes in one pass). Prints milliseconds per body, per group and
the ratio; the best of several rounds, so other load on the machine shows less.

    python bench/body_parse.py                       # 16 groups of G = 8 samples of 64 tokens, as bench/load_api.py
    python bench/body_parse.py --groups 256 --tokens 512
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from typing import Any

from echo2.protocol import RolloutSubmit
from pydantic import TypeAdapter


def submission(groups: int, group_size: int, tokens: int, vocab: int, seed: int = 0) -> bytes:
    """A submission as a worker sends it: token ids, behaviour logprobs and text for each sample."""
    rng = random.Random(seed)

    def sample() -> dict[str, Any]:
        return {"token_ids": [rng.randrange(vocab) for _ in range(tokens)],
                "logprobs": [round(-rng.expovariate(2.0), 5) for _ in range(tokens)],
                "text": "".join(rng.choice("abcdefghij ") for _ in range(4 * tokens)), "finish_reason": "length"}

    return json.dumps({"groups": [{"prompt_id": p, "version": 0, "prompt_token_ids": list(range(24)),
                                   "gen_seconds": 1.5, "samples": [sample() for _ in range(group_size)]}
                                  for p in range(groups)]}).encode()


def best_ms(read: Callable[[bytes], RolloutSubmit], body: bytes, calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(calls):
            read(body)
        best = min(best, (time.process_time() - t0) / calls * 1000)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=16, help="groups per body")
    p.add_argument("--group-size", type=int, default=8, help="G: samples per group")
    p.add_argument("--tokens", type=int, default=64, help="completion tokens per sample")
    p.add_argument("--vocab", type=int, default=49_152, help="token ids drawn below this")
    p.add_argument("--calls", type=int, default=40, help="bodies read per round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    body = submission(args.groups, args.group_size, args.tokens, args.vocab)
    fastapi_way = TypeAdapter(RolloutSubmit)
    ways = {"json.loads + validate (FastAPI)": lambda b: fastapi_way.validate_python(json.loads(b),
                                                                                      from_attributes=True),
            "validate the bytes (ModelBody)": RolloutSubmit.model_validate_json}
    assert ways["json.loads + validate (FastAPI)"](body) == ways["validate the bytes (ModelBody)"](body)
    print(f"body: {args.groups} groups x {args.group_size} samples x {args.tokens} tokens = {len(body):,} bytes; "
          f"CPU ms, best of {args.rounds} rounds of {args.calls}")
    ms = {name: best_ms(read, body, args.calls, args.rounds) for name, read in ways.items()}
    for name, value in ms.items():
        print(f"  {name:34s} {value:8.2f} ms a body  {value / args.groups:6.3f} ms a group")
    before, after = ms.values()
    print(f"  ratio (ModelBody / FastAPI)      {after / before:8.2f}x   saved {(before - after) / args.groups:.3f} "
          "ms a group")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
