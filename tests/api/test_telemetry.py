"""`/metrics` during a training run: the job and worker series hold what the routes recorded."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from api.models import Job, Worker
from tests.factories import (
    activate,
    bill_past_budget,
    fake_model_folder,
    new_job,
    new_provider,
    new_user,
    new_worker,
    ok,
    publish,
    running_job,
    step_report,
    submit_group,
)


def scrape(api) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every sample on /metrics: name -> {sorted labels: value}."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(api.admin.get("/metrics").text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(samples: dict[str, Any], name: str, **labels: str) -> float:
    return samples[name][tuple(sorted(labels.items()))]


def test_metrics_follow_a_training_run(api, tmp_path):
    _, user = new_user(api)
    folder = fake_model_folder(tmp_path / "model")
    job, learner = running_job(api, user, folder, staleness=2)
    jid = job["id"]
    _, provider = new_provider(api)
    worker_id, worker = new_worker(api, provider)
    activate(api, worker_id, jid)
    lease = ok(worker.post("/v1/leases", json={"job_id": jid, "max_prompts": 3, "version": 0}), 201)
    ids = [ok(submit_group(worker, lease, p, 0))["results"][0]["rollout_id"] for p in lease["prompts"]]
    ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": 0, "max_groups": 10}))
    ok(learner.post(f"/v1/jobs/{jid}/learner/steps",
                    json=step_report(0, ids, reward_mean=0.75, tokens=48, staleness_hist=[3, 0, 0])))
    ok(learner.post(f"/v1/jobs/{jid}/learner/heartbeat", json={"step": 1, "busy_s": 3.0, "wall_s": 4.0}))
    publish(learner, jid, folder, version=1, step=1)
    ok(worker.post(f"/v1/workers/{worker_id}/heartbeat",  # it fetched v1: dissemination done
                   json={"status": "active", "job_id": jid, "version_held": 1, "versions_held": [0, 1]}))
    bill_past_budget(api, jid)  # two scheduler ticks a second apart: the learner's time is billed (no budget)

    m = scrape(api)
    assert value(m, "echo2_job_step", job=jid) == 1
    assert value(m, "echo2_job_reward_mean", job=jid) == 0.75
    assert value(m, "echo2_job_learner_utilization_ratio", job=jid) == 0.75
    assert value(m, "echo2_job_trained_tokens_total", job=jid) == 48
    assert value(m, "echo2_job_workers_active", job=jid) == 1
    # Three groups trained fresh (staleness 0): every bucket from le=0 up holds them, and the mean is 0.
    buckets = {dict(k)["le"]: v for k, v in m["echo2_job_rollout_staleness_steps_bucket"].items()}
    assert buckets == {"0.0": 3, "1.0": 3, "2.0": 3, "+Inf": 3}
    assert value(m, "echo2_job_rollout_staleness_steps_count", job=jid) == 3
    assert value(m, "echo2_job_rollout_staleness_steps_sum", job=jid) == 0
    v1 = next(v for v in ok(user.get(f"/v1/jobs/{jid}/versions")) if v["version"] == 1)
    assert v1["dissemination_s"] is not None
    assert value(m, "echo2_job_dissemination_seconds", job=jid) == v1["dissemination_s"]
    with api.db.session() as s:
        spent = s.get(Job, jid)
        assert spent is not None and spent.learner_usd > 0
        assert value(m, "echo2_job_cost_usd_total", job=jid, kind="learner") == spent.learner_usd
        assert value(m, "echo2_job_cost_usd_total", job=jid, kind="workers") == spent.workers_usd
        w = s.get(Worker, worker_id)
        assert w is not None
        assert value(m, "echo2_worker_info", worker=worker_id, status="active", trust="probation", job=jid) == 1
        assert value(m, "echo2_worker_earned_usd_total", worker=worker_id) == w.earned_usd
        assert w.activated_mu is not None  # the ticks activated it on the job at a rate
        assert value(m, "echo2_worker_mu_groups_per_second", worker=worker_id) == w.activated_mu
    assert value(m, "echo2_worker_accepted_groups_total", worker=worker_id) == 3
    assert value(m, "echo2_worker_rejected_groups_total", worker=worker_id) == 0


def test_metrics_cover_paused_jobs_and_leave_out_finished_jobs_and_deregistered_workers(api, tmp_path):
    _, user = new_user(api)
    new_job(user)  # queued: no training series until a learner runs it
    folder = fake_model_folder(tmp_path / "model")
    done, _ = running_job(api, user, folder)
    ok(user.post(f"/v1/jobs/{done['id']}/cancel"))
    paused, _ = running_job(api, user, folder, budget_usd=0.5, learner={"price_per_hour": 3600.0})
    bill_past_budget(api, paused["id"])
    assert ok(user.get(f"/v1/jobs/{paused['id']}"))["status"] == "paused"
    _, provider = new_provider(api)
    gone_id, gone = new_worker(api, provider, name="gone")
    stays_id, _ = new_worker(api, provider, name="stays")
    assert gone.delete(f"/v1/workers/{gone_id}").status_code == 204

    m = scrape(api)
    assert {dict(k)["job"] for k in m["echo2_job_step"]} == {paused["id"]}
    assert value(m, "echo2_job_cost_usd_total", job=paused["id"], kind="learner") >= 0.5
    workers = {dict(k)["worker"] for k in m["echo2_worker_info"]}
    assert workers == {stays_id}
    assert value(m, "echo2_jobs", status="cancelled") == value(m, "echo2_jobs", status="queued") == 1


def _mismatch(kl: float, ess: float, clipped: float, masked: float) -> list[dict[str, Any]]:
    """A step's mismatch rows: staleness 0 (8 tokens), 1 (4 tokens), then all 12."""
    fresh = {"staleness": 0, "tokens": 8, "kl": kl, "ess": ess, "clipped": clipped, "masked": masked}
    stale = {"staleness": 1, "tokens": 4, "kl": 2 * kl, "ess": ess, "clipped": 0.5, "masked": 0.0}
    whole = {"staleness": -1, "tokens": 12, "kl": 4 * kl / 3, "ess": ess, "clipped": (8 * clipped + 2) / 12,
             "masked": 8 * masked / 12}
    return [fresh, stale, whole]


def test_mismatch_series_follow_the_newest_step(api, tmp_path):
    """The learner's mismatch rows reach /metrics (newest step, by staleness and "all"), the job's metrics,
    and its report (pooled over the steps, token-weighted)."""
    _, user = new_user(api)
    folder = fake_model_folder(tmp_path / "model")
    job, learner = running_job(api, user, folder, staleness=1)
    jid = job["id"]
    _, provider = new_provider(api)
    worker_id, worker = new_worker(api, provider)
    activate(api, worker_id, jid)
    steps = [_mismatch(1e-4, 0.99, 0.0, 0.0), _mismatch(0.3, 0.6, 0.25, 0.125)]  # the behaviour perturbed
    for step, rows in enumerate(steps):
        ok(worker.post(f"/v1/workers/{worker_id}/heartbeat", json={"status": "active", "job_id": jid,
                                                                    "version_held": step, "versions_held": [step]}))
        lease = ok(worker.post("/v1/leases", json={"job_id": jid, "max_prompts": 1, "version": step}), 201)
        ids = [ok(submit_group(worker, lease, p, step))["results"][0]["rollout_id"] for p in lease["prompts"]]
        ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": step, "max_groups": 10}))
        ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=step_report(step, ids, staleness_hist=[1, 0],
                                                                           mismatch=rows)))
        publish(learner, jid, folder, version=step + 1, step=step + 1)
        m = scrape(api)
        for name, field in (("echo2_job_mismatch_kl", "kl"), ("echo2_job_ess", "ess"),
                            ("echo2_job_is_clipped_ratio", "clipped"), ("echo2_job_is_masked_ratio", "masked")):
            assert value(m, name, job=jid, staleness="0") == rows[0][field]
            assert value(m, name, job=jid, staleness="1") == rows[1][field]
            assert value(m, name, job=jid, staleness="all") == rows[2][field]
    served = [m["mismatch"] for m in ok(user.get(f"/v1/jobs/{jid}/metrics"))]
    assert served == steps
    pooled = {r["staleness"]: r for r in ok(user.get(f"/v1/jobs/{jid}/report"))["mismatch"]}
    assert list(pooled) == [0, 1, -1]
    assert pooled[0]["tokens"] == 16 and pooled[0]["kl"] == (1e-4 + 0.3) / 2
    assert pooled[-1]["masked"] == (0 + 8 * 0.125 / 12) / 2
