"""Where the worker keeps things, and the registration it reuses.

Credentials (the provider token and this machine's worker id + token, per server) live in
`credentials.json` under the user's config directory (platformdirs), mode 0600, written atomically:
`servers[server]` the worker saved last, `beside[server]` those other joins on this config dir saved before it
(`join --new` registers a second worker beside the first; each restarts as itself).
Benchmark results live next to it; weight versions under the user's cache directory (or --data-dir).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import platformdirs
from echo2.snapshots import atomic_write

APP = "echo2-worker"


def config_dir() -> Path:
    return platformdirs.user_config_path(APP)


def default_data_dir() -> Path:
    return platformdirs.user_cache_path(APP)


def normalize_server(url: str) -> str:
    url = url.strip().rstrip("/")
    if not (url.startswith("http://") or url.startswith("https://")):
        raise ValueError(f"--server {url!r} is not an http:// or https:// URL")
    if url.endswith("/v1"):  # the worker adds /v1/... itself: a second one finds none of the routes
        raise ValueError(f"--server {url!r} ends in /v1: give the control plane's base URL without it, "
                         f"--server {url.removesuffix('/v1')}")
    return url


@dataclass
class SavedWorker:
    """What `join` remembers about one server. Tokens are secrets: never logged, never printed."""

    server: str
    provider_token: str | None = None
    worker_id: str | None = None
    worker_token: str | None = None
    name: str | None = None
    registered_at: str | None = None
    registration: dict[str, Any] = field(default_factory=dict)

    def public(self) -> dict[str, Any]:
        """The fields safe to show a person."""
        return {"server": self.server, "worker_id": self.worker_id, "name": self.name,
                "registered_at": self.registered_at, "registration": self.registration,
                "has_provider_token": self.provider_token is not None}


class CredentialStore:
    def __init__(self, directory: Path | None = None) -> None:
        self.dir = Path(directory) if directory else config_dir()
        self.path = self.dir / "credentials.json"

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {"servers": {}, "beside": {}}
        except (OSError, ValueError) as exc:
            raise ValueError(f"{self.path} is unreadable ({exc}); move it away to start afresh") from None
        if not (isinstance(data, dict) and isinstance(data.get("servers"), dict)):
            return {"servers": {}, "beside": {}}
        return data | {"beside": data["beside"] if isinstance(data.get("beside"), dict) else {}}

    def load(self, server: str) -> SavedWorker | None:
        """The worker saved last for the server."""
        return next(iter(self.saved(server)), None)

    def saved(self, server: str) -> list[SavedWorker]:
        """Every worker saved for the server, the last saved first."""
        return [_saved_worker(e) for e in _entries(self._read(), normalize_server(server))]

    def all(self) -> list[SavedWorker]:
        data = self._read()
        return [_saved_worker(e) for server in data["servers"] for e in _entries(data, server)]

    def save(self, saved: SavedWorker) -> None:
        """Save the worker as the server's last; the others saved for it, with a worker, stay beside it."""
        data = self._read()
        others = [e for e in _entries(data, saved.server) if e.get("worker_id") not in (None, saved.worker_id)]
        data["servers"][saved.server], data["beside"][saved.server] = asdict(saved), others
        write_private(self.path, json.dumps(data, indent=2).encode())

    def forget_worker(self, server: str, worker_id: str) -> None:
        """Drop the worker id and token (after deregistration); keep the provider token. Only `worker_id`'s: another
        join on this config dir may have saved its own since."""
        data, server = self._read(), normalize_server(server)
        last = data["servers"].get(server)
        if isinstance(last, dict) and last.get("worker_id") == worker_id:
            last.update(worker_id=None, worker_token=None, registered_at=None)
        data["beside"][server] = [e for e in _beside(data, server) if e.get("worker_id") != worker_id]
        write_private(self.path, json.dumps(data, indent=2).encode())


def _entries(data: dict[str, Any], server: str) -> list[dict[str, Any]]:
    """The server's saved workers, the last saved first."""
    last = data["servers"].get(server)
    return ([last] if isinstance(last, dict) else []) + _beside(data, server)


def _beside(data: dict[str, Any], server: str) -> list[dict[str, Any]]:
    beside = data["beside"].get(server)
    return [e for e in beside if isinstance(e, dict)] if isinstance(beside, list) else []


def _saved_worker(entry: dict[str, Any]) -> SavedWorker:
    return SavedWorker(**{k: v for k, v in entry.items() if k in SavedWorker.__dataclass_fields__})


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def write_private(path: Path, data: bytes) -> None:
    """Write a secret file: mode 0600 from the first byte, atomically replaced."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write(path, data, mode=0o600)


def load_bench(directory: Path | None = None) -> dict[str, Any] | None:
    path = (Path(directory) if directory else config_dir()) / "bench.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def save_bench(result: dict[str, Any], directory: Path | None = None) -> Path:
    path = (Path(directory) if directory else config_dir()) / "bench.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path
