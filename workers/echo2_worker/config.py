"""Where the worker keeps things, and the registration it reuses.

Credentials (the provider token and this machine's worker id + token, per server) live in
`credentials.json` under the user's config directory (platformdirs), mode 0600, written atomically.
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
            return {"servers": {}}
        except (OSError, ValueError) as exc:
            raise ValueError(f"{self.path} is unreadable ({exc}); move it away to start afresh") from None
        return data if isinstance(data, dict) and isinstance(data.get("servers"), dict) else {"servers": {}}

    def load(self, server: str) -> SavedWorker | None:
        entry = self._read()["servers"].get(normalize_server(server))
        if not isinstance(entry, dict):
            return None
        known = {k: v for k, v in entry.items() if k in SavedWorker.__dataclass_fields__}
        return SavedWorker(**known)

    def all(self) -> list[SavedWorker]:
        return [SavedWorker(**{k: v for k, v in e.items() if k in SavedWorker.__dataclass_fields__})
                for e in self._read()["servers"].values() if isinstance(e, dict)]

    def save(self, saved: SavedWorker) -> None:
        data = self._read()
        data["servers"][saved.server] = asdict(saved)
        write_private(self.path, json.dumps(data, indent=2).encode())

    def forget_worker(self, server: str, worker_id: str) -> None:
        """Drop the worker id and token (after deregistration); keep the provider token. Only `worker_id`'s: another
        join on this config dir may have saved its own since."""
        saved = self.load(server)
        if saved is not None and saved.worker_id == worker_id:
            saved.worker_id = saved.worker_token = saved.registered_at = None
            self.save(saved)


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
