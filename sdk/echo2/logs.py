"""Logging of every Echo2 process: lines for people, or one JSON object per line for a log pipeline.

    from echo2 import logs
    logs.configure("json", "INFO")    # {"ts": "...", "level": "info", "logger": "...", "msg": "..."}

The control plane, scheduler and learner host take the format from their settings (`ECHO2_LOG_FORMAT`);
rollout workers and learner ranks, which have no settings object, read the same variable through
`env_format`. A JSON line holds ts (UTC, ISO 8601), level, logger and msg, plus exc (the formatted
traceback) when the record carries one.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime
from typing import IO, Any, Literal, get_args

LogFormat = Literal["text", "json"]
FORMAT_ENV = "ECHO2_LOG_FORMAT"
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in a message or traceback are escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(self.fields(record))

    def fields(self, record: logging.LogRecord) -> dict[str, Any]:
        """What a line holds; a subclass adds or rewrites fields here."""
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return out


def formatter(fmt: str, text: str = TEXT) -> logging.Formatter:
    """A JsonFormatter for "json", else a plain one with the `text` layout."""
    if fmt not in get_args(LogFormat):
        raise ValueError(f"log format must be 'text' or 'json', not {fmt!r} (see {FORMAT_ENV})")
    return JsonFormatter() if fmt == "json" else logging.Formatter(text)


def configure(fmt: str, level: int | str = logging.INFO, text: str = TEXT, stream: IO[str] | None = None) -> None:
    """The root logger writes to `stream` (stderr) in `fmt`. Like logging.basicConfig, it changes nothing
    when the root logger already has a handler: the process's entry point, which runs first, decides."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter(fmt, text))
    logging.basicConfig(level=level, handlers=[handler])


def env_format() -> str:
    """ECHO2_LOG_FORMAT (default text), for processes without a settings object."""
    return os.environ.get(FORMAT_ENV, "text")
