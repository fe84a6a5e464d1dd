"""Proof of possession: a worker holds a version once it has shown it, not when its heartbeat says so.

At publication the learner sends secret PROBES of the version (echo2.possession: ranges of its model
folder, each with the sha256 of its bytes), stored in `WeightVersion.probes` and never shown. A worker
whose heartbeat lists a version of its job it has not proven is challenged in the reply with the range
of one probe, picked by an HMAC of the worker's secret salt and the version: every retry asks the same,
so a worker cannot ask until it gets a range it happens to have, and other workers are asked other
ranges. It answers in its next heartbeat (`Heartbeat.proofs`). A right answer records the hold
(`VersionHold`, `held_at` = `proven_at` = then: dissemination is timed by proofs); a wrong one is a
strike, the worker having claimed bytes it does not hold. `pool._check_version` leases only at a proven
version. A version published without probes (before this check existed, or by a learner that sent
none) is held when a heartbeat claims it, as before.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from echo2.protocol import Challenge, Proof
from sqlalchemy import select
from sqlalchemy.orm import Session

from ..db import insert_skipping_conflicts
from ..models import VersionHold, WeightVersion


@dataclass
class Claim:
    """What one heartbeat says about the versions of the worker's job it holds."""

    worker_id: str
    job_id: str
    salt: str  # Worker.audit_salt: secret, so the worker cannot tell which probe it will be asked
    held: set[int]
    proofs: list[Proof] = field(default_factory=list)


class Possession:
    """Challenges and proofs for one batch of heartbeats: the probes of the versions they list and their
    workers' proven holds, read in two queries."""

    def __init__(self, db: Session, claims: Iterable[Claim]) -> None:
        self.claims = {c.worker_id: c for c in claims}
        jobs = {c.job_id for c in self.claims.values()}
        versions = {v for c in self.claims.values() for v in c.held}
        self.probes: dict[tuple[str, int], list[dict[str, Any]]] = {}
        self.proven: set[tuple[str, int, str]] = set()
        if not jobs or not versions:
            return
        self.probes = {(r.job_id, r.version): r.probes for r in db.execute(
            select(WeightVersion.job_id, WeightVersion.version, WeightVersion.probes)
            .where(WeightVersion.job_id.in_(jobs), WeightVersion.version.in_(versions),
                   WeightVersion.probes.is_not(None)))}
        if self.probes:
            self.proven = {(r.job_id, r.version, r.worker_id) for r in db.execute(
                select(VersionHold.job_id, VersionHold.version, VersionHold.worker_id)
                .where(VersionHold.worker_id.in_(self.claims), VersionHold.version.in_(versions),
                       VersionHold.proven_at.is_not(None)))}

    def check(self, db: Session, now: datetime) -> dict[str, str]:
        """Judge every proof that answers an open challenge and record the holds proven. Returns, per worker
        that answered wrong, the reason to strike it for."""
        rows, wrong = [], {}
        for claim in self.claims.values():
            right, bad = self._judge(claim)
            self.proven |= {(claim.job_id, v, claim.worker_id) for v in right}
            rows += [{"job_id": claim.job_id, "version": v, "worker_id": claim.worker_id, "held_at": now,
                      "proven_at": now} for v in right]
            if bad:
                wrong[claim.worker_id] = (f"answered the possession challenge for version(s) {sorted(bad)} of job "
                                          f"{claim.job_id} wrongly: it claimed weights it does not hold")
        if rows:
            db.execute(insert_skipping_conflicts(db, VersionHold), rows)
        return wrong

    def challenges(self, worker_id: str) -> list[Challenge]:
        """What the reply asks the worker to prove: each version it lists that has probes and is unproven."""
        claim = self.claims.get(worker_id)
        if claim is None:
            return []
        out = []
        for version in sorted(claim.held):
            probe = self._open(claim, version)
            if probe is not None:
                out.append(Challenge(version=version, offset=probe["offset"], length=probe["length"]))
        return out

    def _judge(self, claim: Claim) -> tuple[set[int], set[int]]:
        """The versions the claim's proofs prove, and those they answer wrong. A proof that answers no open
        challenge (a version not listed, without probes or proven already, or another range) is ignored."""
        right, wrong = set(), set()
        for proof in claim.proofs:
            probe = self._open(claim, proof.version)
            if probe is None or (probe["offset"], probe["length"]) != (proof.offset, proof.length):
                continue
            (right if hmac.compare_digest(probe["sha256"], proof.sha256) else wrong).add(proof.version)
        return right - wrong, wrong

    def _open(self, claim: Claim, version: int) -> dict[str, Any] | None:
        """The probe the worker is challenged with for `version`, while that challenge is open."""
        probes = self.probes.get((claim.job_id, version))
        if version not in claim.held or not probes or (claim.job_id, version, claim.worker_id) in self.proven:
            return None
        pick = hmac.new(claim.salt.encode(), f"possession:{claim.job_id}:{version}".encode(), hashlib.sha256)
        return probes[int.from_bytes(pick.digest()[:8], "big") % len(probes)]


def probed(db: Session, job_id: str, version: int) -> bool | None:
    """Whether the version was published with probes; None when it was never published (with κ > 1 not every
    number below the latest is a version)."""
    return db.scalar(select(WeightVersion.probes.is_not(None))
                     .where(WeightVersion.job_id == job_id, WeightVersion.version == version))


def proven(db: Session, job_id: str, version: int, worker_id: str) -> bool:
    """Whether the worker proved it holds `version` (one published with probes: `probed`)."""
    return db.scalar(select(VersionHold.proven_at).where(
        VersionHold.job_id == job_id, VersionHold.version == version, VersionHold.worker_id == worker_id)) is not None
