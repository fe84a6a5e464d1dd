"""Plain-text output: aligned tables, numbers, times, paging hints and a job's description."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..protocol import JobRead


def num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def when(t: Any) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S")


def table(header: list[str], rows: list[list[Any]]) -> None:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    if not rows:
        print("(none)")


def more(offset: int, shown: int, total: int, next_offset: int | None) -> None:
    if next_offset is not None:
        print(f"({offset + shown} of {total} entries; more with --offset {next_offset})")


def describe(job: JobRead) -> None:
    spec = job.spec
    rows = [
        ("id", job.id), ("name", spec.name),
        ("status", job.status.value + (f" ({job.status_reason})" if job.status_reason else "")),
        ("model", spec.base_model),
        ("task", spec.task.name + (f" {spec.task.params}" if spec.task.params else "")),
        ("step", f"{job.step}/{spec.max_steps}"),
        ("version", "-" if job.version is None else str(job.version)),
        ("staleness S", str(spec.staleness)), ("prompts", str(job.num_prompts)),
        ("reward", num(job.reward_mean)),
        ("cost", f"${job.cost.total_usd:.4f} (learner ${job.cost.learner_usd:.4f}, "
                 f"workers ${job.cost.workers_usd:.4f})"),
        ("created", job.created_at.isoformat(timespec="seconds")),
        ("started", job.started_at.isoformat(timespec="seconds") if job.started_at else "-"),
        ("finished", job.finished_at.isoformat(timespec="seconds") if job.finished_at else "-"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


class ProgressBar:
    """A progress bar on stderr: redrawn in place on a terminal, a line every 10% elsewhere."""

    def __init__(self, label: str, width: int = 30) -> None:
        self.label, self.width, self.shown = label, width, -1
        self.tty = sys.stderr.isatty()

    def update(self, done: int, total: int) -> None:
        share = done / total if total else 1.0
        tenth = int(share * 10)
        if not self.tty and tenth == self.shown:
            return
        self.shown = tenth
        filled = int(share * self.width)
        line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {share:4.0%} "
                f"{done / 2**20:.1f}/{total / 2**20:.1f} MiB")
        sys.stderr.write(("\r" + line) if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty and self.shown >= 0:
            sys.stderr.write("\n")
