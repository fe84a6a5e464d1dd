"""Time for each worker to hold a newly published version (T_bcast), per relay topology.

A version of M bytes moves in chunks of c bytes; a relay forwards each verified chunk while it
still receives later ones (pipelining), so a worker at depth d whose stream runs at B bytes/s
holds the version after about M/B + d·(c/B + hop latency) — `capacity.estimate_bcast_s`.

* tree:  peers sorted by uplink (high-uplink near the root) and placed breadth-first, `fanout`
         children per relay and `origin_fanout` under the origin. A relay splits its uplink
         evenly among its children, so a peer's stream runs at min(own downlink, parent's
         stream, parent's uplink / parent's children). Thin-uplink peers end up as leaves and
         slow only themselves.
* chain: one child per relay and under the origin: depth N, each hop at the full uplink.
* star:  everyone downloads from the origin, which splits its uplink N ways.

Failures during a broadcast are not modelled: a version reaches every worker that was active
when it was published (the real relay falls back to another parent or the origin).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.capacity import estimate_bcast_s


@dataclass(frozen=True, slots=True)
class Peer:
    key: int
    down_Bps: float
    up_Bps: float


@dataclass(frozen=True, slots=True)
class Broadcast:
    times: dict[int, float]  # peer key -> seconds after publication
    max_depth: int
    newcomer_rate_Bps: float  # what one more leaf can expect: median rate parents offer a leaf


def broadcast(
    peers: Sequence[Peer],
    model_bytes: float,
    chunk_bytes: float,
    origin_up_Bps: float,
    topology: str = "tree",
    fanout: int = 2,
    hop_latency_s: float = 0.0,
    origin_fanout: int | None = None,
) -> Broadcast:
    n = len(peers)
    if topology == "star":
        share = origin_up_Bps / max(n, 1)
        down = np.array([p.down_Bps for p in peers])
        took = estimate_bcast_s(model_bytes, down, share, 1, chunk_bytes, hop_latency_s)
        return Broadcast(dict(zip((p.key for p in peers), took.tolist(), strict=True)), 1, origin_up_Bps / (n + 1))
    if topology == "chain":
        fanout = origin_fanout = 1
    origin_fanout = origin_fanout or fanout
    if n == 0:
        return Broadcast({}, 0, origin_up_Bps / origin_fanout)
    order = sorted(peers, key=lambda p: (-p.up_Bps, p.key))
    # breadth-first placement: parent -1 is the origin, then each placed peer in turn
    parent = [-1 if i < origin_fanout else (i - origin_fanout) // fanout for i in range(n)]
    children = [0] * n
    for par in parent:
        if par >= 0:
            children[par] += 1
    under_origin = min(n, origin_fanout)
    rate = [0.0] * n
    depth = [0] * n
    for i, p in enumerate(order):
        par = parent[i]
        if par < 0:
            rate[i], depth[i] = min(p.down_Bps, origin_up_Bps / under_origin), 1
        else:
            rate[i] = min(p.down_Bps, rate[par], order[par].up_Bps / children[par])
            depth[i] = depth[par] + 1
    down = np.array([p.down_Bps for p in order])
    took = estimate_bcast_s(model_bytes, down, np.array(rate), np.array(depth), chunk_bytes, hop_latency_s)
    times = dict(zip((p.key for p in order), took.tolist(), strict=True))
    # what a leaf's parent offers, whatever the leaf's own downlink
    offers = [
        origin_up_Bps / under_origin
        if parent[i] < 0
        else min(rate[parent[i]], order[parent[i]].up_Bps / children[parent[i]])
        for i in range(n)
        if children[i] == 0
    ]
    return Broadcast(times, max(depth), statistics.median(offers))
