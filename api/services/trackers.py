"""Where a job's experiment tracker may send or write (JobSpec.tracking), checked at submission.

The learner host runs the tracker with its own credentials (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN) on its own
disk: a tenant naming the address would be handed the operator's token, and naming a path would have the host
write there. Never into Echo2's own data or database; in production only to what the operator allows
(`Settings.tracking_targets`)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from echo2.protocol import JobSpec, TrackerKind
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from ..errors import ApiError
from ..settings import Settings

LOOPBACK = (None, "", "localhost", "127.0.0.1", "::1")  # a URL with no host (None, "") is a local socket
DEFAULT_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}


def check_tracking(spec: JobSpec, settings: Settings) -> None:
    cfg = spec.tracking
    if cfg is None:
        return
    targets = [("tracking.uri", cfg.uri), ("tracking.dir", cfg.dir if cfg.kind == TrackerKind.wandb else None)]
    for field, target in targets:
        if target is None:
            continue
        problem = _platform_own(target, settings)
        if problem is None and settings.env == "production" and not _allowed(target, settings.tracking_targets):
            allowed = ", ".join(settings.tracking_targets) or "none"
            problem = (f"{target} is not a tracker this platform's learner hosts send to (they send their own "
                       f"credentials there; allowed: {allowed}): leave it out to use the hosts' own tracker "
                       "settings, or ask the operator to add it to ECHO2_TRACKING_TARGETS")
        if problem is not None:
            raise ApiError(422, problem, field=field)


def _platform_own(target: str, settings: Settings) -> str | None:
    """Why `target` is Echo2's own data or database, or None."""
    if _same_database(target, settings.database_url):
        return f"{target} is the platform's own database: name a tracker of your own"
    path = _local_path(target)
    if path is not None and path.is_relative_to(settings.data_dir.expanduser().resolve()):
        return (f"{target} is inside Echo2's own data on this host ({settings.data_dir}), where other jobs' files "
                "are: name a tracker outside it")
    return None


def _same_database(target: str, database_url: str) -> bool:
    """A SQLite database is its file; any other, its server and name."""
    if urlsplit(database_url).scheme.split("+")[0] == "sqlite":
        return _local_path(target) == _local_path(database_url)
    try:
        theirs, ours = make_url(target), make_url(database_url)
    except ArgumentError:
        return False
    return _server(theirs) == _server(ours)


def _server(url: URL) -> tuple[str, str | None, int | None, str | None]:
    backend = url.get_backend_name()
    host = "localhost" if url.host in LOOPBACK else url.host
    return backend, host, url.port or DEFAULT_PORTS.get(backend), url.database


def _local_path(target: str) -> Path | None:
    """The file or folder a target writes on the learner host (an MLflow sqlite:/file: store, a bare path, a W&B
    dir), links followed; None for a remote tracker."""
    scheme = urlsplit(target).scheme.split("+")[0]  # a dialect+driver scheme is the same store (MLflow, SQLAlchemy)
    if scheme == "sqlite":
        path = target.split(":///", 1)[1] if ":///" in target else ""
    elif scheme == "file":
        path = urlsplit(target).path
    elif scheme == "" or len(scheme) == 1:  # a bare path (or a Windows drive letter)
        path = target
    else:
        return None
    return Path(path or ".").expanduser().resolve()


def _allowed(target: str, allowed: list[str]) -> bool:
    """`target` is one of `allowed` or under one: a path inside an allowed folder, a URL at or below an allowed
    URL (whole path segments: http://mlflow:5000 does not allow http://mlflow:5000.evil.com)."""
    path = _local_path(target)
    for entry in allowed:
        base = _local_path(entry)
        if path is not None and base is not None and path.is_relative_to(base):
            return True
        if path is None and base is None and (target == entry or target.startswith(entry.rstrip("/") + "/")):
            return True
    return False
