"""Which artifacts a worker fetches to hold a job's newest version: the cheapest path in bytes.

Every version after the first is published as a delta against the version published just before it
(`echo2.deltas`), and every K-th one (and any whose delta would not be small) also in full, as a
keyframe. So the versions form one chain, and a worker reaches version v from either
- a version it already holds, then every delta after it up to v; or
- a keyframe k <= v, downloaded whole, then every delta after k up to v.
`plan` walks the chain back from v and takes the cheapest start. A worker that lacks everything
(a newcomer) starts at the newest keyframe; one holding v - 1 takes one delta. A LoRA job's adapter
versions are all published in full and apply to its base (version 0), which comes first when the
worker lacks it.
"""

from __future__ import annotations

from dataclasses import dataclass

from echo2.protocol import Form


@dataclass(frozen=True)
class Forms:
    """What the origin stores of one version: sizes in bytes, None when that form was not published."""

    full_size: int | None
    delta_size: int | None
    delta_base: int | None
    adapter_base: int | None = None  # a LoRA adapter version: loading it needs this version too


def plan(versions: dict[int, Forms], target: int, held: set[int]) -> list[tuple[int, Form]] | None:
    """The (version, form) artifacts to fetch in order so as to hold `target` (and, for a LoRA adapter,
    the base it applies to, first); [] when it is held, None when no path exists (a gap in the chain
    and no keyframe after it)."""
    base = versions[target].adapter_base if target in versions else None
    if base is not None and base not in held:
        first, rest = _plan(versions, base, held), _plan(versions, target, held | {base})
        return None if first is None or rest is None else first + rest
    return _plan(versions, target, held)


def _plan(versions: dict[int, Forms], target: int, held: set[int]) -> list[tuple[int, Form]] | None:
    if target in held:
        return []
    best: tuple[int, list[tuple[int, Form]]] | None = None
    deltas: list[tuple[int, Form]] = []
    cost, version = 0, target
    while (forms := versions.get(version)) is not None:
        if forms.full_size is not None and (best is None or cost + forms.full_size < best[0]):
            best = (cost + forms.full_size, [(version, Form.full), *deltas])
        if version in held:
            return [*deltas] if best is None or cost <= best[0] else best[1]
        if forms.delta_size is None or forms.delta_base is None:
            break
        cost += forms.delta_size
        deltas.insert(0, (version, Form.delta))
        version = forms.delta_base
    return best[1] if best is not None else None
