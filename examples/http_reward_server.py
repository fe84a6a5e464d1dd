"""A reward server for the `http_reward` task: your own verifier, behind HTTP, on the trusted side.

    python examples/http_reward_server.py --port 8080
    # then submit a job with task {"name": "http_reward", "params": {"url": "http://HOST:8080/reward"}}
    # and a dataset of {"prompt": ..., "reference": ...} items (reference optional)

The learner POSTs {"prompt", "completion", "reference"} as JSON for every completion it trains on and
expects {"reward": <finite number>} back (a bare number works too). How the learner treats answers
(tasks/http_reward.py): a 429 or 5xx is retried with backoff, honouring Retry-After; any
other status, or a reply that is not a finite number, leaves the sample unscored (it is dropped).
So this server answers 400 for a malformed request (retrying cannot fix it) and 503 when it is
overloaded (retrying can).

The scoring below is an example: exact match of the completion's final answer against the
reference, partial credit when the reference appears anywhere, and a small penalty for rambling.
Replace `score()` with your own check. Standard library only; ThreadingHTTPServer serves requests
concurrently, so keep `score()` thread-safe. GET /healthz answers {"status": "ok"}.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY_BYTES = 1 << 20
MAX_IN_FLIGHT = 64
_FINAL = re.compile(r"(?:####|answer\s*(?:is|:))\s*(.+)$", re.IGNORECASE | re.MULTILINE)


def _normalize(text: str) -> str:
    return re.sub(r"[\s$,.!]+", " ", text).strip().casefold()


def final_answer(completion: str) -> str:
    """The text after the last "#### " or "answer is"/"answer:", else the last non-empty line."""
    found = _FINAL.findall(completion)
    if found:
        return found[-1]
    lines = [line for line in completion.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def score(prompt: str, completion: str, reference: str | None) -> float:
    """1.0 for an exact final answer, 0.5 when the reference appears elsewhere, minus up to 0.2 for length."""
    if reference is None or not _normalize(reference):
        return 0.0  # nothing to compare with: an example policy, change it for reference-free tasks
    ref = _normalize(reference)
    if _normalize(final_answer(completion)) == ref:
        reward = 1.0
    elif re.search(rf"(?<!\w){re.escape(ref)}(?!\w)", _normalize(completion)):
        reward = 0.5
    else:
        return 0.0
    rambling = max(0, len(completion) - 400) / 2000
    return round(max(0.0, reward - min(0.2, rambling)), 4)


class RewardHandler(BaseHTTPRequestHandler):
    server_version = "echo2-reward-example/1.0"
    in_flight = threading.BoundedSemaphore(MAX_IN_FLIGHT)

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path == "/healthz":
            self._reply(200, {"status": "ok"})
        else:
            self._reply(404, {"error": "not found; POST /reward"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path.split("?", 1)[0] != "/reward":
            return self._reply(404, {"error": "not found; POST /reward"})
        if not self.in_flight.acquire(blocking=False):
            return self._reply(503, {"error": "busy"}, {"Retry-After": "1"})
        try:
            body, problem = self._read_json()
            if problem:
                return self._reply(400, {"error": problem})
            reward = score(body["prompt"], body["completion"], body.get("reference"))
            if not math.isfinite(reward):
                return self._reply(500, {"error": "score() returned a non-finite number"})
            self._reply(200, {"reward": reward})
        finally:
            self.in_flight.release()

    def _read_json(self) -> tuple[dict[str, Any], str | None]:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            return {}, "Content-Length required"
        if not 0 < length <= MAX_BODY_BYTES:
            return {}, f"body must be 1..{MAX_BODY_BYTES} bytes"
        try:
            body = json.loads(self.rfile.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return {}, "body is not JSON"
        if not isinstance(body, dict):
            return {}, "body must be a JSON object"
        for key in ("prompt", "completion"):
            if not isinstance(body.get(key), str):
                return {}, f"{key!r} must be a string"
        if body.get("reference") is not None and not isinstance(body["reference"], str):
            return {}, "'reference' must be a string or null"
        return body, None

    def _reply(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        if self.server.verbose:  # type: ignore[attr-defined]
            super().log_message(format, *args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Example reward server for Echo2's http_reward task.")
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 to serve other machines)")
    p.add_argument("--port", type=int, default=8080, help="port (0 = any free port)")
    p.add_argument("-v", "--verbose", action="store_true", help="log every request")
    args = p.parse_args(argv)

    server = ThreadingHTTPServer((args.host, args.port), RewardHandler)
    server.daemon_threads = True
    server.verbose = args.verbose  # type: ignore[attr-defined]
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    host, port = server.server_address[:2]
    print(f"reward server on http://{host}:{port}/reward (GET /healthz)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
