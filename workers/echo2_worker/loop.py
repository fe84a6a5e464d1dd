"""The worker loop: heartbeat -> follow the desired state -> hold the assigned version -> lease
prompts -> generate G samples each -> submit version-tagged groups -> repeat.

Four threads share one `Worker`:
- the heartbeat thread reports liveness, progress and bad relay sources every interval (even while a
  long generation runs) and at once when a version download completes or a new version is announced,
  keeps the latest reply, and renews the lease in progress before it expires;
- the notice thread (notice.VersionWatcher) long-polls for the next version of the job and asks for
  that heartbeat as soon as one is published;
- a download thread fetches the assigned version (versions.py: a keyframe and/or deltas, through the
  relay tree) while the current, still admissible version keeps generating;
- the main thread leases, generates and submits, and swaps weights between leases.

Versions: a lease is taken with the version loaded in the backend, and every group of it is tagged
with that version. When a newer version is announced the current lease is finished (if still
admissible) and the weights are swapped before the next lease. A lease whose version fell below the
assignment's `min_version` is released without generating more: its rollouts would be rejected.
Only the loaded and the newest version (and what a download in flight uses) are kept on disk.

Drain (SIGTERM/SIGINT, `request_drain`): stop leasing, submit the batch in flight, release the rest,
deregister, exit 0. A SIGKILL loses nothing: the server expires the lease and re-pools its prompts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from echo2 import errors
from echo2.prompting import encode_prompt
from echo2.protocol import (
    Assignment,
    BadSource,
    DesiredState,
    EpisodeLimits,
    GroupSubmit,
    Heartbeat,
    HeartbeatReply,
    LeasedPrompt,
    LeaseRead,
    LeaseRequest,
    RolloutSubmit,
    SampleSubmit,
    WorkerStatus,
)
from echo2.seeds import sample_seed

from . import episodes
from .backends import GenerationBackend, GenRequest, GenSample
from .control import ControlPlane
from .notice import VersionWatcher
from .partial import PartialRollouts, oldest_version, runs_of
from .progress import Stats
from .store import VersionStore
from .versions import MAX_BACKOFF_S, Versions, backoff

log = logging.getLogger(__name__)

MIN_LOGPROB = -1e4  # the protocol's floor; a sampled token is never that unlikely in practice


class WorkerGone(Exception):
    """The control plane no longer knows this worker (deregistered elsewhere, or token revoked)."""


@dataclass
class LoopOptions:
    worker_id: str
    data_dir: Path
    max_prompts: int = 8
    gen_batch_prompts: int | None = None  # prompts per backend call; None = the whole lease
    heartbeat_interval_s: float = 2.0
    relay_url: str | None = None


@dataclass
class _LeaseState:
    lease: LeaseRead
    ttl_s: float
    renew_at: float


class Worker:
    def __init__(self, options: LoopOptions, control: ControlPlane, backend_factory: Callable[[], GenerationBackend],
                 store: VersionStore, stats: Stats | None = None,
                 on_deregistered: Callable[[], None] | None = None) -> None:
        self.opt = options
        self.control = control
        self.store = store
        self.stats = stats or Stats()
        self._on_deregistered = on_deregistered
        self._reply: HeartbeatReply | None = None
        self._reply_lock = threading.Lock()
        self._changed = threading.Event()
        self._drain = threading.Event()
        self._stop_heartbeat = threading.Event()
        self._heartbeat_now = threading.Event()  # set to heartbeat before the interval is up
        self._fatal: BaseException | None = None
        self._status = WorkerStatus.idle
        self._leases: dict[str, _LeaseState] = {}
        self._lease_lock = threading.Lock()
        self._net = ThreadPoolExecutor(max_workers=1, thread_name_prefix="echo2-net")
        self._prefetched: Future[LeaseRead | None] | None = None
        self._bad: dict[str, str] = {}
        self._reported: tuple[str | None, frozenset[int]] = (None, frozenset())  # what the last beat said
        self._bad_lock = threading.Lock()
        self._lease_attempts = 0
        self._gen_failures = 0
        self.versions = Versions(control, store, self.stats, backend_factory, relay_url=options.relay_url,
                                 on_held=self._version_changed, on_bad_source=self._report_bad)
        self._partial = PartialRollouts(self.versions, lambda: (r := self._latest()) and r.assignment, self._parents)
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, name="echo2-heartbeat", daemon=True)
        self._watcher = VersionWatcher(control, self._watching, self._heartbeat_now.set)

    # -- public ----------------------------------------------------------------------------------

    def request_drain(self) -> None:
        """Stop leasing; the batch in flight is submitted, the rest of the lease released; then exit."""
        self._drain.set()
        self.versions.cancel()
        self._changed.set()

    @property
    def draining(self) -> bool:
        return self._drain.is_set()

    def run(self) -> int:
        """Work until drained; returns the process exit code."""
        self._hb_thread.start()
        self._watcher.start()
        try:
            while not self._drain.is_set():
                if self._fatal is not None:
                    raise self._fatal
                reply = self._latest()
                if reply is None or reply.desired is not DesiredState.active or reply.assignment is None:
                    draining = reply is not None and reply.desired is DesiredState.drain
                    self._set_status(WorkerStatus.draining if draining else WorkerStatus.idle)
                    self._drop_prefetch(release=True)
                    self._wait(1.0)
                    continue
                self._set_status(WorkerStatus.active)
                if self._ready(reply.assignment):
                    self._work_one_lease()
            return 0
        except WorkerGone as exc:
            log.error("%s", exc)
            if self._on_deregistered is not None:
                self._on_deregistered()
            return 3
        finally:
            self._shutdown()

    # -- versions --------------------------------------------------------------------------------

    def _ready(self, a: Assignment) -> bool:
        """True when the backend holds an admissible version to lease with (versions.py)."""
        loaded = self.versions.loaded
        ready = self.versions.hold(a, lambda: self._parents(a)) is not None
        if self.versions.loaded != loaded:
            self._drop_prefetch(release=True)  # it was leased with the version just replaced
        if not ready:
            self._wait(1.0)
        return ready

    def _version_changed(self) -> None:
        self._heartbeat_now.set()
        self._changed.set()

    def _parents(self, a: Assignment) -> list[str]:
        reply = self._latest()
        if reply is not None and reply.assignment is not None and reply.assignment.job_id == a.job_id:
            return reply.assignment.relay_parents
        return a.relay_parents

    # -- leases ----------------------------------------------------------------------------------
    # Network calls that need not block generation run in order on one "net" thread: the next lease
    # is requested while the current one generates, and submissions go out while the next batch
    # generates. Order on that thread keeps each lease's submissions before its release.

    def active_leases(self) -> list[LeaseRead]:
        with self._lease_lock:
            return [s.lease for s in self._leases.values()]

    def _work_one_lease(self) -> str:
        lease = self._take_lease()
        if not isinstance(lease, LeaseRead):
            return lease
        try:
            done, ok = self._generate_lease(lease)
            self._gen_failures = 0
        except (WorkerGone, KeyboardInterrupt):
            raise
        except Exception as exc:  # a backend failure: give the prompts back, retry a few times
            self._net_call(self._finish, lease, 0, False)
            self._gen_failures += 1
            if self._gen_failures >= 3:
                raise
            log.warning("generation failed (%s: %s); retrying", type(exc).__name__, exc)
            self._wait(backoff(self._gen_failures))
            return "error"
        self._net_call(self._finish, lease, done, ok)
        return "done"

    def _take_lease(self) -> LeaseRead | str:
        """The prefetched lease when it is for the loaded version, else a lease asked for now."""
        assert self.versions.loaded is not None
        prefetched = self._drop_prefetch(release=False)
        if prefetched is not None:
            if (prefetched.job_id, prefetched.version) == self.versions.loaded:
                return prefetched
            self._net_call(self._finish, prefetched, 0, False)
        job_id, version = self.versions.loaded
        if not self._reported_holding(job_id, version):
            return "unreported"
        try:
            lease = self.control.lease(LeaseRequest(job_id=job_id, max_prompts=self.opt.max_prompts, version=version))
        except errors.ConflictError as exc:
            if exc.retry_after is not None:  # no prompts free right now
                self._wait(min(exc.retry_after, 5.0))
                return "idle"
            log.info("lease refused: %s", exc.detail)  # too stale or job not running: wait for the next reply
            self._await_new_reply(5.0)
            return "refused"
        except errors.PermissionDeniedError:
            self._await_new_reply(5.0)
            return "refused"
        except errors.AuthenticationError as exc:
            raise WorkerGone(f"the control plane no longer accepts this worker's token ({exc.status})") from None
        except errors.Echo2Error as exc:
            self._lease_attempts += 1
            delay = backoff(self._lease_attempts)
            log.warning("could not lease prompts (%s); retrying in %.1fs", exc, delay)
            self._wait(delay)
            return "error"
        self._lease_attempts = 0
        self._track(lease)
        return lease

    def _reported_holding(self, job_id: str, version: int) -> bool:
        """A lease is granted only at a version a heartbeat reported: after a download, wait for one."""
        deadline = time.monotonic() + 10.0
        while self._reported[0] != job_id or version not in self._reported[1]:
            if self._drain.is_set() or time.monotonic() > deadline:
                return False
            self._heartbeat_now.set()
            self._wait(0.05)
        return True

    def _prefetch(self) -> None:
        """Ask for the next lease in the background, unless a swap or a drain is coming."""
        held = self.versions.settled()
        if self._prefetched is not None or self._drain.is_set() or held is None:
            return
        job_id, version = held

        def call() -> LeaseRead | None:
            try:
                lease = self.control.lease(LeaseRequest(job_id=job_id, max_prompts=self.opt.max_prompts,
                                                        version=version))
            except errors.Echo2Error:
                return None  # the main loop asks again itself, and handles the answer
            self._track(lease)
            return lease

        self._prefetched = self._net.submit(call)

    def _drop_prefetch(self, release: bool = True) -> LeaseRead | None:
        future, self._prefetched = self._prefetched, None
        lease = future.result() if future is not None else None
        if lease is not None and release:
            self._net_call(self._finish, lease, 0, False)
            return None
        return lease

    def _generate_lease(self, lease: LeaseRead) -> tuple[int, bool]:
        """Generate the lease's prompts batch by batch, each batch submitted in the background.
        Returns how many prompts were generated, and False if a submission was refused."""
        step = self.opt.gen_batch_prompts or len(lease.prompts)
        done = 0
        refused = threading.Event()
        while done < len(lease.prompts):
            why = "a submission was refused" if refused.is_set() else self._stop_reason(lease)
            if why:
                log.info("lease %s: stopping after %d/%d prompts (%s)", lease.id, done, len(lease.prompts), why)
                break
            self._prefetch()
            batch = lease.prompts[done : done + step]
            groups = self._generate(batch, lease)
            self._net_call(self._submit, lease, groups, refused)
            done += len(batch)
        return done, not refused.is_set()

    def _stop_reason(self, lease: LeaseRead) -> str | None:
        if self._drain.is_set():
            return "draining"
        reply = self._latest()
        if reply is None:
            return None
        a = reply.assignment
        if reply.desired is not DesiredState.active or a is None or a.job_id != lease.job_id:
            return f"desired state is {reply.desired.value}"
        # With partial rollouts the lease does not pin the version: its next batch starts on the newest held.
        version = self._partial.refresh() if lease.sampling.partial_rollouts else lease.version
        if version < a.min_version:
            return f"version {version} is too stale (oldest admissible: {a.min_version})"
        return None

    def _generate(self, prompts: list[LeasedPrompt], lease: LeaseRead) -> list[GroupSubmit]:
        backend = self.versions.backend
        assert backend is not None
        sampling, version = lease.sampling, lease.version
        g = sampling.group_size
        prompt_ids = [encode_prompt(self.versions.tokenizer, p.text) for p in prompts]
        if lease.episode is not None:
            return self._play(prompts, prompt_ids, lease, lease.episode)
        requests = [GenRequest(prompt_token_ids=ids, n=g, seeds=[sample_seed(p.seed, k) for k in range(g)],
                               max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                               top_p=sampling.top_p, top_k=sampling.top_k)
                    for p, ids in zip(prompts, prompt_ids, strict=True)]
        t0 = time.monotonic()
        outputs = self._partial.generate(requests) if sampling.partial_rollouts else backend.generate(requests)
        seconds = time.monotonic() - t0
        tokens = sum(len(s.token_ids) for group in outputs for s in group)
        self.stats.tokens.add(tokens)
        return [GroupSubmit(prompt_id=p.prompt_id, version=oldest_version(group, version), prompt_token_ids=ids,
                            samples=[_sample(s) for s in group], gen_seconds=round(seconds / len(prompts), 4))
                for p, ids, group in zip(prompts, prompt_ids, outputs, strict=True)]

    def _play(self, prompts: list[LeasedPrompt], prompt_ids: list[list[int]], lease: LeaseRead,
              limits: EpisodeLimits) -> list[GroupSubmit]:
        """Multi-turn: every sample an episode, played with the control plane (episodes.py)."""
        assert self.versions.backend is not None
        t0 = time.monotonic()
        groups = episodes.play(self.versions.backend, self.control, lease.id,
                               [(p.prompt_id, p.seed, ids) for p, ids in zip(prompts, prompt_ids, strict=True)],
                               lease.sampling, limits)
        seconds = time.monotonic() - t0
        self.stats.tokens.add(sum(len(s.token_ids) for group in groups for s in group))
        return [GroupSubmit(prompt_id=p.prompt_id, version=lease.version, prompt_token_ids=ids, samples=samples,
                            gen_seconds=round(seconds / len(prompts), 4))
                for p, ids, samples in zip(prompts, prompt_ids, groups, strict=True)]

    # -- on the net thread -----------------------------------------------------------------------

    def _net_call(self, fn: Callable[..., Any], *args: Any) -> None:
        def run() -> None:
            try:
                fn(*args)
            except WorkerGone as exc:
                self._fatal = exc
                self._changed.set()
            except Exception:
                log.exception("background %s failed", getattr(fn, "__name__", "call"))

        self._net.submit(run)

    def _submit(self, lease: LeaseRead, groups: list[GroupSubmit], refused: threading.Event) -> None:
        """Submit (idempotent per prompt, so retried until the lease would have expired)."""
        deadline = time.monotonic() + self._ttl_left(lease.id)
        attempt = 0
        while True:
            try:
                result = self.control.submit(lease.id, RolloutSubmit(groups=groups))
                break
            except errors.AuthenticationError as exc:
                raise WorkerGone(f"the control plane no longer accepts this worker's token ({exc.status})") from None
            except (errors.ConnectionError, errors.ServerError) as exc:
                if time.monotonic() > deadline:
                    log.warning("giving up on lease %s: %s (its prompts return to the pool)", lease.id, exc)
                    refused.set()
                    return
                attempt += 1
                log.warning("submit failed (%s); retrying", exc)
                time.sleep(backoff(attempt))
            except errors.APIStatusError as exc:
                log.warning("lease %s: submission refused: %s", lease.id, exc)
                refused.set()
                return
        accepted = [r for r in result.results if r.status.value == "accepted"]
        rejected = [r for r in result.results if r.status.value == "rejected"]
        self.stats.rollouts_accepted += len(accepted)
        self.stats.rollouts_rejected += len(rejected)
        self.stats.groups.add(len(accepted))
        for r in rejected[:3]:
            log.warning("prompt %d rejected: %s", r.prompt_id, r.reason)

    def _finish(self, lease: LeaseRead, done: int, ok: bool) -> None:
        """After the lease's submissions: release what was not generated (all answered = completed)."""
        try:
            if done < len(lease.prompts) or not ok:
                self._release(lease, done)
            else:
                self.stats.leases_done += 1
        finally:
            with self._lease_lock:
                self._leases.pop(lease.id, None)

    def _release(self, lease: LeaseRead, done: int) -> None:
        try:
            self.control.release(lease.id)
            log.info("released lease %s (%d of %d prompts not generated)", lease.id, len(lease.prompts) - done,
                     len(lease.prompts))
        except errors.Echo2Error as exc:
            log.warning("could not release lease %s (%s); it will expire server-side", lease.id, exc)

    def _track(self, lease: LeaseRead) -> None:
        ttl = max(1.0, (lease.expires_at - lease.created_at) / timedelta(seconds=1))
        with self._lease_lock:
            self._leases[lease.id] = _LeaseState(lease, ttl, time.monotonic() + ttl / 2)

    def _ttl_left(self, lease_id: str) -> float:
        with self._lease_lock:
            state = self._leases.get(lease_id)
            if state is None:
                return 0.0
            return max(0.0, state.renew_at + state.ttl_s / 2 - time.monotonic())

    # -- heartbeat thread ------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        failures = 0
        while not self._stop_heartbeat.is_set():
            interval = self.opt.heartbeat_interval_s
            try:
                body = self._heartbeat_body()
                reply = self.control.heartbeat(self.opt.worker_id, body)
                self._reported = (body.job_id, frozenset(body.versions_held))
                if failures:
                    log.info("control plane reachable again")
                failures = 0
                interval = reply.heartbeat_interval_s
                with self._reply_lock:
                    self._reply = reply
                self._changed.set()
                self._renew_leases()
            except errors.AuthenticationError as exc:
                self._fatal = WorkerGone(f"the control plane no longer accepts this worker's token ({exc.status}); "
                                         "it was deregistered elsewhere - run `echo2-worker join` again")
                self._changed.set()
                return
            except errors.Echo2Error as exc:
                failures += 1
                interval = min(MAX_BACKOFF_S, interval * 2 ** min(failures, 5))
                log.warning("heartbeat failed (%s); next try in %.0fs", exc, interval)
            self._heartbeat_now.wait(interval)
            self._heartbeat_now.clear()

    def _heartbeat_body(self) -> Heartbeat:
        with self._bad_lock:
            bad = [BadSource(url=u, reason=r[:500]) for u, r in list(self._bad.items())[:32]]
            self._bad.clear()
        job, held = self.versions.holdings()
        return Heartbeat(status=self._status, job_id=job, version_held=max(held) if held else None,
                         versions_held=held, stats=self.stats.worker_stats(), bad_sources=bad,
                         fetched_from=self.versions.take_fetched()[:16])

    def _renew_leases(self) -> None:
        now = time.monotonic()
        with self._lease_lock:
            due = [st for st in self._leases.values() if now >= st.renew_at]
        for state in due:
            try:
                self.control.renew(state.lease.id)
                state.renew_at = time.monotonic() + state.ttl_s / 2
                log.debug("renewed lease %s", state.lease.id)
            except errors.Echo2Error as exc:
                log.warning("could not renew lease %s: %s", state.lease.id, exc)

    def _report_bad(self, url: str, reason: str) -> None:
        with self._bad_lock:
            self._bad[url] = reason

    # -- helpers ---------------------------------------------------------------------------------

    def _watching(self) -> tuple[str, int] | None:
        """The job and newest version the last heartbeat named, for the version watcher."""
        reply = self._latest()
        if reply is None or reply.assignment is None:
            return None
        return reply.assignment.job_id, reply.assignment.version

    def _latest(self) -> HeartbeatReply | None:
        with self._reply_lock:
            return self._reply

    def _wait(self, seconds: float) -> None:
        self._changed.wait(seconds)
        self._changed.clear()

    def _await_new_reply(self, timeout: float) -> None:
        first = self._latest()
        deadline = time.monotonic() + timeout
        while not self._drain.is_set() and self._latest() is first and time.monotonic() < deadline:
            self._wait(deadline - time.monotonic())

    def _set_status(self, status: WorkerStatus) -> None:
        self._status = status
        self.stats.state = "draining" if self._drain.is_set() else status.value

    def _shutdown(self) -> None:
        """Flush submissions, release what is still leased, stop heartbeating, deregister (on drain)."""
        self._drain.set()
        self.versions.cancel()
        self.stats.state = "stopping"
        try:
            self._drop_prefetch(release=True)
        except Exception as exc:  # the prefetch failed: nothing to give back
            log.debug("prefetch: %s", exc)
        self._net.shutdown(wait=True)  # the batch in flight is submitted; releases go out
        for lease in self.active_leases():
            self._release(lease, 0)
        self._watcher.stop()
        self._stop_heartbeat.set()
        self._heartbeat_now.set()
        if self._hb_thread.is_alive():
            self._hb_thread.join(timeout=5)
        if self._fatal is None:
            try:
                self.control.deregister(self.opt.worker_id)
                log.info("deregistered worker %s", self.opt.worker_id)
                if self._on_deregistered is not None:
                    self._on_deregistered()
            except errors.Echo2Error as exc:
                log.warning("could not deregister (%s); the server will mark this worker offline", exc)
        self.versions.close()

def _sample(s: GenSample) -> SampleSubmit:
    return SampleSubmit(token_ids=s.token_ids, logprobs=[max(MIN_LOGPROB, min(0.0, lp)) for lp in s.logprobs],
                        text=s.text.replace("\x00", "")[:32_768], finish_reason=s.finish_reason, versions=runs_of(s))
