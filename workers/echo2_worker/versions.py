"""The worker's weights: hold the version its assignment names, keep the backend on an admissible one,
and swap between leases.

Holding a version means carrying out the assignment's fetch plan: a keyframe and/or deltas, chosen by
the control plane as the fewest bytes from what this worker reported holding. Each step is downloaded
through the relay tree (fetch.Downloader: every chunk checked against its manifest); a delta is then
applied to the version before it (echo2.deltas.apply_delta: every rebuilt file checked against the
sha256 the learner published) before anything loads it. A delta that does not fit (the held base is not
what the delta was made against, or a file does not rebuild to its hash) is refused: the base is
dropped, the next heartbeat no longer reports it, and the control plane's next plan starts from a
keyframe. A LoRA job's versions are adapters: the backend loads the base (the job's version 0, kept by
digest for every job on it) with the adapter. Downloads run in a thread while the loaded version, still
admissible, keeps generating. A load that fails (a GPU out of memory for a moment) leaves the backend empty and
is tried again after a pause, longer each time, with an error in the log from the third failure in a row; files
that no longer hash to their manifest are deleted then, and fetched again (a version whose files are not of their
manifest's size is not taken as held at all: store.HeldVersion).
"""

from __future__ import annotations

import errno
import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from echo2 import errors
from echo2.deltas import DeltaError, apply_delta, files_digest
from echo2.possession import answer
from echo2.protocol import Assignment, Challenge, Fetched, FetchStep, Form, Manifest, Proof
from echo2.transport import RetryPolicy

from .backends import GenerationBackend
from .control import ControlPlane
from .fetch import DownloadCancelled, Downloader, FetchResult, VersionUnavailable
from .progress import Stats
from .store import VersionStore

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 30.0

VersionKey = tuple[str, int]  # (job id, version)


PAUSES = RetryPolicy(initial_delay=0.5, max_delay=MAX_BACKOFF_S)  # after failed bookings and generations
DOWNLOAD_PAUSES = RetryPolicy(initial_delay=1.0, max_delay=MAX_BACKOFF_S)  # and loads
LOAD_FAILURES_SAID = 3  # failed loads in a row, from which each is logged as an error, with what to check


class Versions:
    """The versions on disk and the one in the backend.

    Threads: `hold` (and so every swap) runs on the worker's main thread, which alone writes `loaded`,
    `target`, `backend`, `tokenizer` and `_load_*`; the heartbeat thread reads `loaded` and `target`, the
    download thread `target` (and `loaded` as it ends; tuples, replaced whole). The download thread alone writes
    `_retry_at` and `_failures` (read only once it has ended). `_download_lock` guards the download in
    flight (`_thread`, `_plan`) and deletions from disk; `_fetched_lock` guards `_fetched`, which the
    download writes and the heartbeat takes."""

    def __init__(self, control: ControlPlane, store: VersionStore, stats: Stats,
                 backend_factory: Callable[[], GenerationBackend], *, relay_url: str | None,
                 on_held: Callable[[], None], on_bad_source: Callable[[str, str], None]) -> None:
        self.control, self.store, self.stats = control, store, stats
        self._backend_factory, self._on_held = backend_factory, on_held
        self.backend: GenerationBackend | None = None
        self.tokenizer: Any = None
        self.loaded: VersionKey | None = None  # in the backend
        self.target: VersionKey | None = None  # the assigned one
        self._fetched: list[Fetched] = []  # what the last download took from each source, for the next beat
        self._fetched_lock = threading.Lock()
        self._download_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._plan: tuple[str, set[int]] = ("", set())  # job and versions the download in flight writes
        self._retry_at = 0.0
        self._failures = 0
        self._load_retry_at = 0.0  # after a failed load
        self._load_failures = 0
        self.downloader = Downloader(store, origin_token=control.token, on_bad_source=on_bad_source,
                                     meter=stats.download, self_url=relay_url)

    def hold(self, a: Assignment, parents: Callable[[], list[str]]) -> VersionKey | None:
        """The version to lease with: the assigned one, swapped in once it is on disk (it is fetched
        otherwise), else the loaded one while it is still admissible; None when the backend holds neither."""
        self.target = (a.job_id, a.version)
        if self.loaded == self.target:
            return self.loaded
        if self.store.weights(a.job_id, a.version) is None:
            self._ensure_download(a, parents)
        elif time.monotonic() >= self._load_retry_at and self._load(a):
            return self.loaded
        admissible = self.loaded is not None and self.loaded[0] == a.job_id and self.loaded[1] >= a.min_version
        return self.loaded if admissible else None

    def settled(self) -> VersionKey | None:
        """The loaded version when it is the assigned one (no swap is coming), else None."""
        return self.loaded if self.loaded == self.target else None

    def holdings(self) -> tuple[str | None, list[int]]:
        """For the heartbeat: the job whose weights are loaded (before the first load, the one being
        fetched) and its newest loadable versions on disk."""
        loaded, target = self.loaded, self.target
        job = loaded[0] if loaded else target[0] if target else None
        return job, self.store.held(job)[-8:] if job else []

    def prove(self, job_id: str | None, challenges: list[Challenge]) -> list[Proof]:
        """Answers to the control plane's possession challenges, each read from this worker's copy of the
        version; one no longer on disk (deleted since the last beat) goes unanswered."""
        proofs = []
        for c in challenges[:8]:
            folder = self.store.loadable(job_id, c.version) if job_id is not None else None
            if folder is None:
                continue
            try:
                proofs.append(answer(folder.path, folder.files, c))
            except (OSError, ValueError) as exc:
                log.warning("could not prove holding version %d: %s", c.version, exc)
        return proofs

    def _load(self, a: Assignment) -> bool:
        """Swap the assigned version in. A failure (CUDA out of memory while another process frees the card, an
        engine failing to start) is tried again after a pause, as a failed generation is, not the worker's end."""
        try:
            self._swap(a)
        except Exception as exc:
            self._load_failed(a, exc)
            return False
        self._load_failures = 0
        return True

    def _load_failed(self, a: Assignment, exc: Exception) -> None:
        self._unload()  # a failed load leaves the backend half built, a failed reload half updated: start afresh
        self._load_failures += 1
        delay = DOWNLOAD_PAUSES.backoff(self._load_failures)
        self._load_retry_at = time.monotonic() + delay
        log.warning("could not load version %d of job %s (%s: %s); trying again in %.0fs", a.version, a.job_id,
                    type(exc).__name__, exc, delay)
        self._drop_damaged(a.job_id, a.version)
        if self._load_failures >= LOAD_FAILURES_SAID:
            log.error("version %d of job %s failed to load %d times in a row: this worker generates nothing until "
                      "it loads. Check what else uses the GPU (nvidia-smi), lower --gpu-memory or --max-batch, or "
                      "stop the worker (SIGTERM) and run `echo2-worker bench` to see the error alone", a.version,
                      a.job_id, self._load_failures)

    def _drop_damaged(self, job_id: str, version: int) -> None:
        """Delete the version (or its LoRA base) when the failure was its files, damaged on disk with their sizes
        intact; the next heartbeat no longer reports it, and its reply's plan fetches it again."""
        damaged = self.store.damaged(job_id, version)
        if not damaged:
            return
        with self._download_lock:  # deletions from disk, as in _gc
            for v in damaged:
                self.store.drop(job_id, v)
        log.warning("version(s) %s of job %s do not hash to their manifest on disk: deleted, to be fetched again",
                    damaged, job_id)
        self._on_held()

    def _unload(self) -> None:
        backend, self.backend, self.tokenizer, self.loaded = self.backend, None, None, None
        self.stats.version_loaded = None
        if backend is not None:
            try:
                backend.close()
            except Exception as exc:  # it failed already: what it frees is best effort
                log.warning("closing the backend after a failed load: %s: %s", type(exc).__name__, exc)

    def _swap(self, a: Assignment) -> None:
        job_id, version = a.job_id, a.version
        parts = self.store.weights(job_id, version)
        assert parts is not None
        model_dir, adapter_dir = parts
        t0 = time.monotonic()
        if self.backend is not None and (self.loaded is None or self.loaded[0] != job_id):
            self.backend.close()  # another job's model: start from a fresh backend
            self.backend = None
        if self.backend is None:
            self.backend = self._backend_factory()
        if self.loaded is not None and self.loaded[0] == job_id:
            self.backend.reload(model_dir, adapter_dir)
            action = "swapped to"
        else:
            self.backend.load(model_dir, adapter_dir, lora_rank=a.lora_rank)
            self.tokenizer = _tokenizer_of(self.backend, model_dir)
            action = "loaded"
        self.loaded = (job_id, version)
        self.stats.job_id, self.stats.version_loaded = job_id, version
        log.info("%s version %d of job %s in %.1fs", action, version, job_id, time.monotonic() - t0)
        self._gc(job_id, version)

    def take_fetched(self) -> list[Fetched]:
        """What the last download took from each source (the control plane measures relays by it), once."""
        with self._fetched_lock:
            fetched, self._fetched = self._fetched, []
        return fetched

    def cancel(self) -> None:
        """Stop fetching (drain, shutdown): the download in flight ends at its next chunk."""
        self._stop.set()

    def close(self) -> None:
        self.cancel()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.downloader.close()
        if self.backend is not None:
            self.backend.close()

    def _gc(self, job_id: str, loaded: int) -> None:
        """Delete the job's versions on disk but the loaded one, its LoRA base and what a download uses."""
        keep = {loaded}
        if (base := self.store.adapter_base(job_id, loaded)) is not None:
            keep.add(base)
        # Under the lock: never delete what a download in flight (or one starting now) reads or writes, and
        # never sweep the disk from two threads at once (a swap, and a download ending).
        with self._download_lock:
            if self._plan[0] == job_id:
                keep |= self._plan[1]
            dropped = self.store.keep_only(job_id, keep)
        if dropped:
            log.info("deleted versions %s from disk (no longer needed)", dropped)

    def _ensure_download(self, a: Assignment, parents: Callable[[], list[str]]) -> None:
        with self._download_lock:
            if self._thread is not None and self._thread.is_alive():
                return  # an older target notices `wanted()` turning false and stops; this one starts then
            if time.monotonic() < self._retry_at or not a.fetch:
                return
            # What the plan writes, and every held version (a delta's base is one of them or an earlier step).
            self._plan = (a.job_id, {s.version for s in a.fetch} | set(self.store.held(a.job_id)))
            self._thread = threading.Thread(target=self._download, args=(a, parents), name="echo2-download",
                                            daemon=True)
            self._thread.start()

    def _download(self, a: Assignment, parents: Callable[[], list[str]]) -> None:
        key = (a.job_id, a.version)

        def wanted() -> bool:
            return self.target == key and not self._stop.is_set()

        try:
            log.info("fetching version %d of job %s: %s", a.version, a.job_id,
                     ", ".join(f"{s.form.value} {s.version} ({s.size / 1e6:.2f} MB)" for s in a.fetch))
            for i, step in enumerate(a.fetch):
                last = i == len(a.fetch) - 1
                result = self._fetch_step(a, step, parents if last else (lambda: [self.control.server_url]),
                                          wanted, a.relay_key if last else None)
            self._done(a, result)
        except DownloadCancelled:
            log.info("stopped fetching version %d: a newer one is wanted", a.version)
        except DeltaError as exc:
            self._failed(a, f"a delta did not fit: {exc}")
        except OSError as exc:
            self._failed(a, self._disk_full(a) if exc.errno == errno.ENOSPC else str(exc))
        except errors.ConnectionError as exc:
            self._failed(a, str(exc) + self._origin_hint(exc))
        except (VersionUnavailable, errors.Echo2Error, ValueError) as exc:
            self._failed(a, str(exc))
        finally:
            self._finished()

    def _disk_full(self, a: Assignment) -> str:
        """What a provider does about a full disk: the folder, what the version needs and what is free."""
        need = sum(step.size for step in a.fetch)
        free = shutil.disk_usage(self.store.root).free
        return (f"no space left on the disk of {self.store.root}: this version needs {need / 1e9:.2f} GB, "
                f"{free / 1e9:.2f} GB are free; free some, or give --data-dir on a larger disk")

    def _origin_hint(self, exc: errors.ConnectionError) -> str:
        """Weights come from the address the control plane names (its ECHO2_PUBLIC_URL), not from the one this
        worker was given: a control plane left at its loopback default cannot be reached from another machine."""
        if exc.request is None:
            return ""
        named, ours = exc.request.url, httpx.URL(self.control.server_url)
        if (named.scheme, named.host, named.port) == (ours.scheme, ours.host, ours.port):
            return ""
        return (f"; this worker reaches the control plane at {self.control.server_url}, which names "
                f"{named.scheme}://{named.netloc.decode()} for its weights (its ECHO2_PUBLIC_URL): ask its operator to "
                "set ECHO2_PUBLIC_URL to an address workers can reach")

    def _finished(self) -> None:
        """The download no longer needs its versions: when the swap came while it was still running (it
        kept them then), delete now what the loaded version does not need."""
        with self._download_lock:
            self._plan = ("", set())
        loaded = self.loaded
        if loaded is not None and loaded == self.target:
            self._gc(*loaded)

    def _fetch_step(self, a: Assignment, step: FetchStep, parents: Callable[[], list[str]],
                    wanted: Callable[[], bool], relay_key: str | None) -> FetchResult:
        manifest = self.control.manifest(step.manifest_url)
        if (manifest.version, manifest.form) != (step.version, step.form):
            raise ValueError(f"{step.manifest_url} is not the {step.form.value} form of version {step.version}")
        digest, held = files_digest(manifest.target_files()), self.store.open(a.job_id, manifest, relay_key)
        if step.shared and not held.complete and (cached := self.store.shared(digest)) is not None \
                and held.adopt(cached):
            log.info("version %d of job %s is a base model this worker already holds", step.version, a.job_id)
            return FetchResult(held=held, seconds=0.0)
        result = self.downloader.fetch(a.job_id, manifest, parents, wanted, relay_key)
        if manifest.form is Form.delta:
            self._apply(a.job_id, manifest, result.held.model_dir, result.held.rebuilt_dir)
        elif step.shared:
            self.store.share(digest, result.held.model_dir)
        return result

    def _apply(self, job_id: str, manifest: Manifest, payload: Path, out: Path) -> None:
        assert manifest.delta is not None
        base = self.store.loadable(job_id, manifest.delta.base_version)
        if base is None:
            raise DeltaError(f"version {manifest.delta.base_version}, the base of version {manifest.version}, "
                             "is not held")
        try:
            apply_delta(manifest, payload, base, out)
        except DeltaError:
            self.store.drop(job_id, manifest.delta.base_version)  # the next plan starts from a keyframe
            raise

    def _done(self, a: Assignment, result: FetchResult) -> None:
        self.stats.last_download_s = result.seconds
        self.stats.version_held = max(a.version, self.stats.version_held or 0)
        with self._fetched_lock:
            self._fetched = [Fetched(url=u, bytes=n, seconds=result.seconds_from(u))
                             for u, n in result.bytes_from.items()]
        self._failures = 0
        log.info("version %d held (%s)", a.version,
                 ", ".join(f"{_host(u)}: {n / 1e6:.2f} MB" for u, n in result.bytes_from.items()) or "resumed")
        self._on_held()  # tell the control plane at once: it times each version's spread

    def _failed(self, a: Assignment, why: str) -> None:
        self._failures += 1
        self._retry_at = time.monotonic() + DOWNLOAD_PAUSES.backoff(self._failures)
        log.warning("could not fetch version %d: %s", a.version, why)
        self._on_held()  # what this worker holds changed, or may have: a fresh plan comes with the reply


def _tokenizer_of(backend: GenerationBackend, model_dir: Path) -> Any:
    """The tokenizer the prompt ids come from (echo2.prompting.encode_prompt is the shared rule)."""
    tok = getattr(backend, "tokenizer", None)
    if tok is not None:
        return tok
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _host(url: str) -> str:
    return url.split("://", 1)[-1]
