"""Upload caps and rate meters: a thread-safe token bucket and a sliding-window byte counter."""

from __future__ import annotations

import threading
import time
from collections import deque


class TokenBucket:
    """At most `rate` bytes per second on average, with bursts up to `burst` bytes.

    `rate=None` means unlimited. Shared by every connection of a relay, so the cap is on the
    worker's total upload, not per child.
    """

    def __init__(self, rate: float | None, burst: float | None = None) -> None:
        if rate is not None and rate <= 0:
            raise ValueError(f"rate must be > 0 bytes/s (or None for no cap), got {rate}")
        self.rate = rate
        # A burst of ~50 ms of traffic keeps the cap tight while letting 64 KiB writes through.
        self.burst = burst if burst is not None else (max(64 * 1024, rate * 0.05) if rate else 0.0)
        self._tokens = self.burst
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def consume(self, n: int) -> None:
        """Block until `n` bytes may be sent. Requests larger than the burst are paid for in debt."""
        if self.rate is None or n <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


class RateMeter:
    """Bytes (or tokens, or rollouts) per second over the last `window` seconds, plus a running total."""

    def __init__(self, window: float = 5.0) -> None:
        self.window = window
        self.total = 0
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.total += n
            self._events.append((now, n))
            self._trim(now)

    def rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            if not self._events:
                return 0.0
            span = max(now - self._events[0][0], 1.0)
            return sum(n for _, n in self._events) / min(span, self.window)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window:
            self._events.popleft()
