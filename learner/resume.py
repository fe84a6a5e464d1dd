"""Exact resume: a relaunched learner, on any host, continues from a state consistent with the job's records.

Every checkpoint is also stored through the control plane (CheckpointUploader), so a learner started on
another host with an empty work directory fetches it (`sync_checkpoint`). The steps the job committed
after that checkpoint are not thrown away: the control plane kept each one as it was trained — its
groups in order and the rewards the learner computed — and the learner trains them again (`replay`),
which on the same kind of device gives the same weights bit for bit (checked against the version the
dead learner published, `Replay.verified`). So the job's step history has no gap and no step trained
twice, every rollout marked trained is in the weights the model goes on from, and the versions the
workers hold still descend from them.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echo2.snapshots import atomic_write, build_manifest, replace_dir

from . import checkpoint
from .parallel import Solo
from .publisher import role_of
from .remote import ControlPlane

log = logging.getLogger(__name__)


class CheckpointUploader:
    """Stores local checkpoints through the control plane in the background, one at a time: a new one
    waits for the previous upload (so a folder is never pruned while it is being read)."""

    def __init__(self, plane: ControlPlane, chunk_size: int) -> None:
        self.plane, self.chunk_size = plane, chunk_size
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def submit(self, folder: Path, step: int) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._upload, args=(folder, step), name="checkpoint-upload",
                                        daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _upload(self, folder: Path, step: int) -> None:
        try:
            paths = sorted(p for p in folder.iterdir() if p.is_file())
            self.plane.upload_checkpoint(folder, build_manifest(folder, step, step, self.chunk_size, paths=paths))
            log.info("checkpoint of step %d stored through the control plane", step)
        except Exception as exc:  # the local copy still serves a relaunch on this host; the next one retries
            self.error = exc
            log.warning("could not store the checkpoint of step %d through the control plane: %s", step, exc)


def sync_checkpoint(plane: ControlPlane, root: Path, remote_step: int | None) -> None:
    """Make the newest checkpoint — local, or stored through the control plane — this host's `latest`."""
    local = checkpoint.latest_step(root)
    if remote_step is None or (local is not None and local >= remote_step):
        return
    root.mkdir(parents=True, exist_ok=True)
    fetched = root / f"ckpt-{remote_step}.fetch"
    shutil.rmtree(fetched, ignore_errors=True)
    plane.fetch_checkpoint(fetched)
    (fetched / "manifest.json").unlink()
    final = root / f"ckpt-{remote_step}"
    replace_dir(fetched, final)
    atomic_write(root / "latest", final.name.encode())
    log.info("fetched the checkpoint of step %d from the control plane", remote_step)


@dataclass
class Replay:
    steps: int = 0
    verified: bool | None = None  # the replayed weights equal the published version bit for bit


def replay(plane: ControlPlane, trainer: Any, world: Solo, start: int, end: int, consumed: set[str],
           published: int | None) -> Replay:
    """Train committed steps start..end-1 again, as they were trained; check the weights against the
    version the dead learner published at `published` when the replay passes it."""
    done = Replay()
    for step in range(start, end):
        committed = plane.committed_step(step)
        trainer.replay(committed.groups, committed.rewards, step)
        consumed.update(g.rollout_id for g in committed.groups)
        done.steps += 1
        if published == step + 1:
            done.verified = matches_version(plane, trainer, published)
    if done.steps:
        log.info("replayed steps %d..%d committed after the checkpoint%s", start, end - 1,
                 {True: " (bit-exact with the published version)", False: " (NOT bit-exact)", None: ""}[done.verified])
    return done


def matches_version(plane: ControlPlane, trainer: Any, version: int) -> bool:
    """Whether the model's weights serialise (as the publisher writes them) to exactly the published
    version's weight files."""
    expected = {f.path: f.sha256 for f in plane.version_files(version) if f.path.endswith(".safetensors")}
    with tempfile.TemporaryDirectory() as tmp:
        trainer.weights.write(trainer.weights.snapshot(), Path(tmp) / "v", role_of(version, final=False))
        got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (Path(tmp) / "v").glob("*.safetensors")}
    return bool(expected) and got == expected
