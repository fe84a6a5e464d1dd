"""The Tinker learner host: runs the models of Tinker SDK clients for the control plane.

    ECHO2_API_KEY=<admin key> python -m learner.tinker.host --server http://127.0.0.1:8000 --price-per-hour 2

It long-polls the control plane for the next request of a model it holds (or a new model to load while
a slot is free), runs it and reports the result; one request at a time, so each model trains in exactly
the order its client sent. A request whose session ends while it runs stops at its next micro-batch. When
the control plane asks, it parks an idle model (its state to one file under --work-dir, its memory freed)
and loads it back for its next request. A failure of the request (bad
input, a missing checkpoint) is reported as the caller's, anything else as the server's; neither stops the
host.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from echo2.errors import NotFoundError
from echo2.protocol.tinker import (
    ErrorCategory,
    HostClaim,
    HostRequestState,
    HostResult,
    HostWork,
    HostWorkReply,
    LoadPayload,
    RequestKind,
    SamplePayload,
    StateUpload,
)
from echo2.transport import Call, RetryPolicy, Transport

log = logging.getLogger("echo2.tinker.host")
WATCH_S = 5.0  # how often a running request's host asks whether it is still wanted
STATE_CHUNK = 32 * 2**20  # a saved state is uploaded in chunks of this size (api/tinker/states.py)


class Host:
    def __init__(self, server: str, api_key: str, name: str, slots: int, work_dir: Path, device: str,
                 price_per_hour: float = 0.0) -> None:
        policy = RetryPolicy(max_retries=10_000, max_delay=5.0, statuses=frozenset({429, 500, 502, 503, 504}),
                             give_up_after=300.0)
        self.http = Transport(server.rstrip("/"), headers={"Authorization": f"Bearer {api_key}"}, policy=policy)
        self.name, self.slots, self.work_dir, self.device = name, slots, work_dir, device
        self.server = server.rstrip("/")
        self.models: dict[str, Any] = {}
        self.price_per_hour = price_per_hour

    def serve(self, stop: threading.Event) -> None:
        while not stop.is_set():
            batch = self.claim(wait_s=20.0)
            t0 = time.monotonic()
            results = self.sample_batch(batch) if len(batch) > 1 else [self.handle(w) for w in batch]
            seconds = (time.monotonic() - t0) / max(len(batch), 1)  # what the ledger bills each request
            for work, result in zip(batch, results, strict=True):
                self.report(work.request_id, result.model_copy(update={"seconds": round(seconds, 6)}))

    def claim(self, wait_s: float) -> list[HostWork]:
        """The next request, with the sample requests that may run in one batch with it."""
        body = HostClaim(host=self.name, slots=self.slots, wait_s=wait_s, holding=sorted(self.models),
                         price_per_hour=self.price_per_hour)
        answer = self.http.send(Call("POST", "/v1/tinker/host/claim", json=body.model_dump(mode="json"),
                                     timeout=wait_s + 30, replay=True))
        reply = HostWorkReply.model_validate(answer.json())
        for model_id in reply.drop:
            log.info("dropping model %s: its session is over", model_id)
            self.models.pop(model_id, None)
            self.parked_path(model_id).unlink(missing_ok=True)
        for model_id in reply.park:
            self.park(model_id)
        return [reply.work, *reply.more] if reply.work is not None else []

    def parked_path(self, model_id: str) -> Path:
        return self.work_dir / "parked" / f"{hashlib.sha256(model_id.encode()).hexdigest()[:32]}.pt"

    def park(self, model_id: str) -> None:
        """Save an idle model to disk and free its memory: another model waits for the slot."""
        session = self.models.get(model_id)
        if session is None:
            return  # not loaded here: a request asking for it restores nothing, and fails saying so
        session.park(self.parked_path(model_id))
        del self.models[model_id]
        log.info("parked model %s: another model waits for the slot", model_id)

    def sample_batch(self, batch: list[HostWork]) -> list[HostResult]:
        """Sample requests of one model and checkpoint together; if the batch fails, each alone (so one bad
        request fails only itself)."""
        session = self.models.get(batch[0].model_id)
        try:
            if session is None:
                raise LookupError(batch[0].model_id)
            payloads = [SamplePayload.model_validate(w.payload) for w in batch]
            from .session import answer

            return [HostResult(**answer(r)) for r in session.sample(payloads)]
        except Exception:  # noqa: BLE001 - retried one by one below, where each error gets its category
            log.info("a batch of %d sample requests failed; running them one by one", len(batch))
            return [self.handle(w) for w in batch]

    def handle(self, work: HostWork) -> HostResult:
        from .session import UserError  # torch: not before the arguments are parsed

        try:
            session = self._session(work)
            if session is None:
                return HostResult(error=f"this host does not hold model {work.model_id}",
                                  category=ErrorCategory.server)
            if work.kind is RequestKind.create_model:
                return HostResult(info=session.info())
            if work.kind is RequestKind.load_weights:
                self.load_state(session, LoadPayload.model_validate(work.payload))
                return HostResult(step=session.steps)
            with self._watch(work.request_id) as ended:
                session.should_stop = ended.is_set
                result = HostResult(**session.run(work.kind.value, work.payload))
            if work.kind is RequestKind.save_weights:  # a state to load again (load_weights), on any host
                result.state = self.save_state(session, work.model_id, work.payload["name"])
            if work.publish is not None:
                result.published = self.publish(session, work)
            return result
        except (UserError, ValueError) as exc:
            return HostResult(error=str(exc)[:500], category=ErrorCategory.user)
        except Exception as exc:  # a bug or an out-of-memory must fail the request, not the host
            log.exception("request %s (%s) failed", work.request_id, work.kind)
            return HostResult(error=f"learner host error: {type(exc).__name__}: {exc}"[:500],
                              category=ErrorCategory.server)

    @contextlib.contextmanager
    def _watch(self, request_id: str) -> Iterator[threading.Event]:
        """An event set once the control plane no longer waits for the request (its session ended): asked every
        WATCH_S while it runs, so that a dead client's long forward_backward stops and frees the host."""
        ended, done = threading.Event(), threading.Event()

        def watch() -> None:
            while True:
                try:
                    answer = self.http.send(Call("GET", f"/v1/tinker/host/requests/{request_id}", timeout=10))
                except Exception as exc:  # noqa: BLE001 - the control plane away: keep working, ask again
                    log.warning("could not ask whether request %s is still wanted: %s", request_id, exc)
                else:
                    if not HostRequestState.model_validate(answer.json()).running:
                        log.info("stopping request %s: the control plane no longer waits for it", request_id)
                        ended.set()
                        return
                if done.wait(WATCH_S):
                    return

        watcher = threading.Thread(target=watch, name=f"watch-{request_id}", daemon=True)
        watcher.start()
        try:
            yield ended
        finally:
            done.set()

    def publish(self, session: Any, work: HostWork) -> int | None:
        """A sampler checkpoint to the model's fleet job. A failure costs the fleet this checkpoint, not the
        request: its samples are drawn here instead."""
        assert work.publish is not None
        folder = self.work_dir / "fleet" / hashlib.sha256(work.model_id.encode()).hexdigest()[:32]
        try:
            return session.publish(work.publish, work.payload["name"], self.server, folder)
        except Exception:  # noqa: BLE001 - logged; the control plane keeps sampling this checkpoint on the host
            log.exception("publishing checkpoint %s of model %s for the fleet failed", work.payload["name"],
                          work.model_id)
            return None

    def _session(self, work: HostWork) -> Any:
        """The model `work` runs on: built (from a saved state, when its create_model names one), restored from
        its parked state, or the one held; None if none of these."""
        from .session import TinkerSession

        cache, private = self.work_dir / "models", (self.work_dir,)
        if work.kind is RequestKind.create_model:
            session = TinkerSession(work.model, cache, self.device, private)
            if work.payload.get("load"):
                self.load_state(session, LoadPayload.model_validate(work.payload["load"]))
            self.models[work.model_id] = session
            return session
        session = self.models.get(work.model_id)
        if session is None and work.restore:
            path = self.parked_path(work.model_id)
            session = self.models[work.model_id] = TinkerSession.restore(work.model, cache, self.device, path,
                                                                         private)
            path.unlink()
            log.info("restored parked model %s", work.model_id)
        return session

    def state_path(self, model_id: str, name: str) -> Path:
        return self.work_dir / "states" / f"{hashlib.sha256(f'{model_id}/{name}'.encode()).hexdigest()[:32]}.pt"

    def save_state(self, session: Any, model_id: str, name: str) -> StateUpload:
        """Write the state, upload it to the control plane (chunks, each and the whole sha256-checked), and keep
        no copy here: the control plane's is the one every host loads, and the one a delete removes."""
        path = self.state_path(model_id, name)
        session.save_state(path)
        try:
            data = path.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            chunks = [data[i:i + STATE_CHUNK] for i in range(0, len(data), STATE_CHUNK)] or [b""]
            for index, chunk in enumerate(chunks):
                self.http.send(Call("PUT", f"/v1/tinker/host/states/{digest}/chunks/{index}", content=chunk,
                                    headers={"X-Echo2-Sha256": hashlib.sha256(chunk).hexdigest(),
                                             "Content-Type": "application/octet-stream"}, timeout=300, replay=True))
            answer = self.http.send(Call("POST", f"/v1/tinker/host/states/{digest}", json={"chunks": len(chunks)},
                                         timeout=300, replay=True))
            return StateUpload.model_validate(answer.json())
        finally:
            path.unlink(missing_ok=True)

    def load_state(self, session: Any, load: LoadPayload) -> None:
        """A state from the control plane's store (by its digest, checked again here); one saved before states
        were stored there is read from this host's disk, where it was saved."""
        if load.sha256 is None:
            session.load_state(self.state_path(load.model_id, load.name), load.optimizer)
            return
        from .session import UserError

        try:
            answer = self.http.send(Call("GET", f"/v1/tinker/host/states/{load.sha256}", timeout=300), stream=True)
        except NotFoundError:
            raise UserError("that state is no longer stored (deleted, or expired)") from None
        path = self.work_dir / "states" / f"{load.sha256}.download"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            digest = hashlib.sha256()
            with path.open("wb") as out:
                for block in answer.iter_bytes(1 << 20):
                    digest.update(block)
                    out.write(block)
            if digest.hexdigest() != load.sha256:
                raise OSError(f"the downloaded state hashes to {digest.hexdigest()}, not {load.sha256}")
            session.load_state(path, load.optimizer)
        finally:
            answer.close()  # a streamed answer holds its connection until closed
            path.unlink(missing_ok=True)

    def report(self, request_id: str, result: HostResult) -> None:
        self.http.send(Call("POST", f"/v1/tinker/host/requests/{request_id}/result", params={"host": self.name},
                            json=result.model_dump(mode="json", exclude_none=True), replay=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m learner.tinker.host", description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True, help="the control plane's URL")
    parser.add_argument("--name", default=f"{socket.gethostname()}-{os.getpid()}", help="this host's name")
    parser.add_argument("--slots", type=int, default=2, help="models held at once")
    parser.add_argument("--work-dir", type=Path, default=Path(".echo2-cache/tinker"), help="built-in models")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's choice)")
    parser.add_argument("--price-per-hour", type=float, default=0.0,
                        help="$ an hour of this host costs its users: the Tinker ledger bills each request's "
                             "compute time at it")
    args = parser.parse_args(argv)
    if not 0 <= args.price_per_hour <= 10_000:
        parser.error(f"--price-per-hour must be between 0 and 10000, not {args.price_per_hour}")
    api_key = os.environ.get("ECHO2_API_KEY")
    if not api_key:
        parser.error("set ECHO2_API_KEY to an admin API key")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    host = Host(args.server, api_key, args.name, args.slots, args.work_dir, device, args.price_per_hour)
    log.info("Tinker learner host %s serving %s with %d slots on %s", args.name, args.server, args.slots, device)
    with contextlib.suppress(KeyboardInterrupt):
        host.serve(threading.Event())
    return 0


if __name__ == "__main__":
    sys.exit(main())
