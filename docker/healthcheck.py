"""Container health checks for the Echo2 images (stdlib only, except `celery` mode).

    python /opt/echo2/healthcheck.py http URL         2xx from URL (the API: /readyz, i.e. the database answers)
    python /opt/echo2/healthcheck.py tcp HOST PORT    something accepts connections (a worker's chunk relay)
    python /opt/echo2/healthcheck.py celery           this container's Celery node answers a ping
                                                      over the broker in ECHO2_REDIS_URL

Exit 0 when healthy, 1 otherwise, with one line saying why (Docker keeps it in `docker inspect`).
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 5.0


def check_http(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:  # noqa: S310 (our own URL)
            if 200 <= response.status < 300:
                return None
            return f"{url} answered {response.status}"
    except urllib.error.HTTPError as exc:
        return f"{url} answered {exc.code}"
    except OSError as exc:
        return f"{url} unreachable: {exc}"


def check_tcp(host: str, port: int) -> str | None:
    try:
        with socket.create_connection((host, port), timeout=TIMEOUT_S):
            return None
    except OSError as exc:
        return f"{host}:{port} refused: {exc}"


def check_celery(broker: str, hostname: str) -> str | None:
    """A node named `anything@<this container's hostname>` must answer (Celery's default node name is
    celery@%h); another container's node answering does not count."""
    if not broker:
        return "ECHO2_REDIS_URL is not set"
    from celery import Celery

    app = Celery("echo2-healthcheck", broker=broker)
    try:
        replies = app.control.ping(timeout=TIMEOUT_S)
    except Exception as exc:  # broker down: report it, do not crash with a traceback
        return f"broker {broker.split('@')[-1]} unreachable: {type(exc).__name__}: {exc}"
    finally:
        app.close()
    nodes = [name for reply in replies for name in reply]
    if any(name.rsplit("@", 1)[-1] == hostname for name in nodes):
        return None
    return f"no Celery node @{hostname} answered (answered: {', '.join(nodes) or 'none'})"


def main(argv: list[str]) -> int:
    mode = argv[0] if argv else ""
    if mode == "http" and len(argv) == 2:
        problem = check_http(argv[1])
    elif mode == "tcp" and len(argv) == 3:
        problem = check_tcp(argv[1], int(argv[2]))
    elif mode == "celery" and len(argv) in (1, 2):
        hostname = argv[1] if len(argv) == 2 else socket.gethostname()
        problem = check_celery(os.environ.get("ECHO2_REDIS_URL", ""), hostname)
    else:
        sys.stderr.write(__doc__ or "")
        return 2
    if problem:
        sys.stderr.write(f"unhealthy: {problem}\n")
        return 1
    sys.stdout.write("healthy\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
