"""One settings object per process, read once from `ECHO2_*` environment variables."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ECHO2_", extra="ignore")

    env: Literal["dev", "production"] = Field("dev", description="`production` refuses unsafe defaults.")
    data_dir: Path = Field(Path(".echo2"), description="Database file (SQLite), weight chunks, checkpoints.")
    database_url: str = Field("", description="SQLAlchemy URL; default: SQLite file in data_dir.")
    redis_url: str = Field("", description="Celery broker/backend; `echo2-server up` starts a private Redis.")
    host: str = Field("127.0.0.1", description="Address the API binds to.")
    port: int = Field(8000, ge=1, le=65535, description="Port the API binds to.")
    public_url: str = Field("", description="URL workers use to reach the API (default http://host:port).")
    open_provider_registration: bool = Field(False, description="Let anyone sign up as a GPU provider.")
    bootstrap_api_key: str = Field("", description="If set, an admin with this API key is ensured at start.")
    max_body_bytes: int = Field(16 * 2**20, ge=1024, description="Largest JSON request body (413 beyond).")
    max_upload_bytes: int = Field(16 * 2**30, ge=2**20, description="Most bytes one user's dataset uploads in "
                                  "progress may declare together (413 beyond): their parts fill this host's disk.")
    max_chunk_bytes: int = Field(64 * 2**20, ge=4096, description="Largest weight chunk upload.")
    lease_ttl_s: float = Field(60.0, gt=0, description="A lease not renewed or completed by then expires.")
    heartbeat_interval_s: float = Field(2.0, gt=0, description="How often workers should heartbeat.")
    worker_offline_after_s: float = Field(15.0, gt=0, description="No heartbeat for this long: offline.")
    learner_price_per_hour: float = Field(2.0, ge=0, description="Reserved learner price ($/h); a user's job may name "
                                          "a higher one, not a lower.")
    reconcile_interval_s: float = Field(2.0, gt=0, description="Scheduler tick period.")
    learner_start_timeout_s: float = Field(300.0, gt=0, description="A launched learner must start by then.")
    learner_dead_after_s: float = Field(30.0, gt=0, description="No learner heartbeat for this long: relaunch.")
    learner_threads: int | None = Field(None, ge=1, le=1024, description="torch threads per learner run.")
    solver: Literal["milp", "greedy", "all"] = Field("milp", description="Worker activation method.")
    min_dwell_s: float = Field(60.0, ge=0, description="An activated worker keeps its job at least this long.")
    relay_fanout: int = Field(1, ge=1, le=16, description="Children per relay peer (1: a pipelined chain).")
    relay_max_bad_chunks: int = Field(3, ge=1, description="Peers reported bad this often stop being parents.")
    keep_versions_every: int = Field(0, ge=0, description="Also keep the weights of every n-th version stored "
                                     "in full (a keyframe) for download (0: only the final or newest one, kept "
                                     "forever, and those rollouts may still use).")
    retention_sweep_s: float = Field(300.0, ge=0, description="Each API process looks for weights left "
                                     "to collect at start and then this often (0: at start only).")
    archive_after_h: float = Field(24.0, ge=0, description="The retention sweep moves the token payloads of a job "
                                   "that ended this many hours ago, and of a running job's groups rejected this "
                                   "long ago, out of the database into zstd Parquet files under data_dir/archive "
                                   "(its rollouts, traces and the learner's replay still read the same); and "
                                   "deletes multi-turn episodes last played this long ago whose lease ended, "
                                   "the results of Tinker futures whose session ended this long ago, and dataset "
                                   "uploads that received no part for this long.")
    archive_after_steps: int = Field(20, ge=0, le=1_000_000, description="A running job's groups trained this many "
                                     "steps ago (and older than its newest 2,000, which the fleet comparison reads) "
                                     "are archived too.")
    archive_keep_days: float = Field(0.0, ge=0, description="Days after a job ended that its token archive is "
                                     "deleted (its rollouts and traces then answer 410; statuses, rewards, "
                                     "metrics and the ledger stay); 0: kept forever. Weights: see "
                                     "keep_versions_every; learner checkpoints go when the job ends.")
    audit_rate: float = Field(0.1, ge=0, le=1, description="Share of a trusted worker's groups the learner "
                              "re-scores: one in every round(1/rate) of its groups, at a position the worker "
                              "cannot predict (new and suspect workers: every group). A learner waiting for "
                              "rollouts audits more of them meanwhile.")
    probation_audits: int = Field(5, ge=0, le=1000, description="Audits a new worker must pass to be trusted "
                                  "(0: it starts trusted).")
    quarantine_s: float = Field(3600.0, ge=0, description="How long a worker that failed twice gets no leases.")
    tinker_fleet: bool = Field(True, description="Tinker sampling requests may be drawn by rollout workers (a "
                               "user's prompts and adapters then go to them); false: the learner host samples all.")
    learner_max_failures: int = Field(3, ge=1, le=100, description="Learner launches in a row without a "
                                      "committed step before the job fails.")
    pay_rate_fraction: float = Field(0.5, gt=0, le=1, description="A worker is paid in full only while it "
                                     "delivers paid rollouts at this fraction of the rate it was activated for.")
    pay_window_s: float = Field(300.0, gt=0, description="Active time beyond this and what the worker's groups "
                                "waiting to be trained pay for is never paid.")
    trial_share: float = Field(0.25, gt=0, le=1, description="A worker with no measured output counts for at "
                               "most this share of a job's needed throughput, whatever it claims; on a job a measured "
                               "worker delivers for, so do all the workers on trial of a provider that has not "
                               "delivered yet (or whose worker failed its trial lately) together.")
    delivery_grace_s: float = Field(120.0, gt=0, description="An activated worker that delivers nothing for this "
                                    "long is measured at zero throughput (and deactivated), unless it holds prompts "
                                    "for no longer than 3 times what they take at its pace (its claimed rate before "
                                    "it delivered: a CPU worker's first lease).")
    lease_idle_s: float = Field(600.0, gt=0, description="A worker that has held prompts this long without sending "
                                "a group or playing an episode's turn (across leases held one after another), and "
                                "longer than 3 times what its own groups take, is renewed and granted no lease: its "
                                "lease ends, its prompts return, and it is measured at zero throughput as a trial "
                                "that delivered nothing is (prompts held and not generated keep every other worker "
                                "from them).")
    tracking_targets: list[str] = Field(default_factory=list, description="With `production`, the experiment "
                                        "trackers a job's `tracking.uri` and `tracking.dir` may name: http(s) URLs "
                                        "and folders on the learner hosts (a JSON list). The hosts send their own "
                                        "tracker credentials there and write there, so any other is refused; empty: "
                                        "jobs use the hosts' own tracker settings.")
    model_check: Literal["host", "names"] = Field("host", description="How a job's base model is checked at "
                                                  "submission: `host`, as the learner host would load it (folders, "
                                                  "the Hugging Face cache and the Hub, seen from this machine: true of "
                                                  "`echo2-server up`); `names`, only built-in names (learner hosts "
                                                  "on other machines).")
    hf_hub_cache: Path | None = Field(None, description="The Hugging Face cache a job's Hub id is checked "
                                      "against at submission and its config read from for the memory estimate "
                                      "(default: huggingface_hub's own). Learner hosts load through huggingface_hub's "
                                      "HF_HUB_CACHE / HF_HOME: point this at the cache they use.")
    wheel_dir: Path | None = Field(None, description="A folder holding the echo2 and echo2-worker wheels the "
                                   "package index (/simple/) serves; default: built from the source tree into "
                                   "DATA_DIR/wheels at the index's first request (and again when the tree changed).")
    package_upstream: str = Field("https://pypi.org/simple", max_length=512, description="Where the package index "
                                  "sends pip for every other project (the worker's dependencies); empty: 404, and "
                                  "pip uses the indexes of its own configuration.")
    log_level: str = Field("INFO", description="Python logging level.")
    log_format: Literal["text", "json"] = Field("text", description="Log lines for people, or one JSON object "
                                                "per line (ts, level, logger, msg, exc) for a log pipeline.")

    @model_validator(mode="after")
    def _derive(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite:///{(self.data_dir / 'echo2.db').resolve()}"
        if not self.public_url:
            self.public_url = f"http://{self.host}:{self.port}"
        self.public_url = self.public_url.rstrip("/")
        if self.env == "production":
            _refuse_unsafe_production(self)
        return self

    @property
    def blob_dir(self) -> Path:
        return self.data_dir / "blobs"

    @property
    def audit_window(self) -> int:
        """A trusted worker's groups audited together: one of each window of this many (trust.should_audit)."""
        return max(1, round(1 / self.audit_rate)) if self.audit_rate > 0 else 1


def _refuse_unsafe_production(s: Settings) -> None:
    if s.database_url.startswith("sqlite"):
        raise ValueError("ECHO2_ENV=production needs ECHO2_DATABASE_URL pointing at PostgreSQL")
    if s.bootstrap_api_key and len(s.bootstrap_api_key) < 32:
        raise ValueError("ECHO2_BOOTSTRAP_API_KEY is too short for production (>= 32 characters)")
    if s.open_provider_registration:
        raise ValueError("ECHO2_OPEN_PROVIDER_REGISTRATION must be off in production; sign providers up as admin")


@lru_cache
def get_settings() -> Settings:
    return Settings()
