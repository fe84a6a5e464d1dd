"""The dashboard in a real browser (Debian Chromium) against a live control plane, on SQLite and PostgreSQL.

Each test drives the API the way the other parts of Echo2 would (worker leases and rollouts, learner claims
and step reports) and checks that the page shows it without a reload. Screenshots land in docs/screenshots/.
"""

from __future__ import annotations

import re
import tarfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.models import Decision, Job, Worker, utcnow
from api.services.jobs import pause_job
from scheduler.reconcile import tick
from tests.conftest import ADMIN_KEY
from tests.factories import (
    activate,
    bill_past_budget,
    fake_model_folder,
    forms,
    new_job,
    new_provider,
    new_user,
    new_worker,
    ok,
    publish_forms,
    running_job,
    step_report,
    submit_group,
    version_folder,
)
from tests.web.conftest import Dashboard, close_dashboard, open_dashboard

pytestmark = pytest.mark.e2e


def user_key(api: Any, name: str = "alice", role: str = "user") -> tuple[str, httpx.Client]:
    body = ok(api.admin.post("/v1/users", json={"name": name, "role": role}), 201)
    return body["api_key"], api.client(body["api_key"])


def expect_text(ui: Dashboard, selector: str, pattern: str) -> None:
    ui.page.locator(selector).filter(has_text=re.compile(pattern)).first.wait_for()


def train_step(api: Any, job: dict[str, Any], learner: httpx.Client, worker: httpx.Client, root: Path,
               step: int, reward: float) -> None:
    """One learner step the way the real parts do it: lease, rollouts, claim, report, publish (in full
    and as a delta; version 2 as a delta only)."""
    jid = job["id"]
    lease = ok(worker.post("/v1/leases", json={"job_id": jid, "max_prompts": 2, "version": step}), 201)
    ids = [ok(submit_group(worker, lease, p, step))["results"][0]["rollout_id"] for p in lease["prompts"]]
    ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": step, "max_groups": 10}))
    beat = {"step": step, "busy_s": 3.0 + step, "wall_s": 4.0 + step}
    ok(learner.post(f"/v1/jobs/{jid}/learner/heartbeat", json=beat))
    whole = {"staleness": -1, "tokens": 24, "kl": 0.002 * (step + 1), "ess": 0.99 - 0.1 * step, "clipped": 0.0,
             "masked": 0.05 * step}
    report = step_report(step, ids, t_train_s=0.5, reward_mean=reward, loss=0.3 - 0.05 * step, kl=0.01 * step,
                         clip_frac=0.05, tokens=24, mismatch=[{**whole, "staleness": 0}, whole])
    ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=report))
    publish_forms(learner, jid, forms(root, step + 1, full=step + 1 != 2))
    held = {"status": "active", "job_id": jid, "version_held": step + 1}
    ok(worker.post(f"/v1/workers/{lease['worker_id']}/heartbeat", json=held))  # the worker fetched it


def reconcile(api: Any) -> None:
    """One scheduler tick on the live control plane's database (activation decisions are recorded)."""
    with api.db.session() as session:
        tick(session, api.server.settings, lambda job, token, placement: None)


@pytest.fixture
def training(api, tmp_path):
    """Alice's running job (version 0 published) with one active worker of a provider."""
    key, alice = user_key(api)
    folder = version_folder(tmp_path / "model", 0)
    job, learner = running_job(api, alice, folder, name="reward-climb", staleness=2, max_steps=5)
    _, provider = new_provider(api, "gpu-co")
    wid, worker = new_worker(api, provider, name="rtx-1", gpu_model="RTX 4090", gpu_count=1, vram_gb=24,
                             price_per_hour=0.35, rollouts_per_s=1.5, relay_url="http://10.0.0.7:7070")
    activate(api, wid, job["id"])
    ok(worker.post(f"/v1/workers/{wid}/heartbeat", json={"status": "active", "job_id": job["id"], "version_held": 0}))
    return {"key": key, "alice": alice, "job": job, "learner": learner, "worker": worker, "worker_id": wid,
            "folder": folder, "root": folder.parent}


def test_login_with_keyboard_then_logout(api, ui):
    key, _ = user_key(api)
    ui.goto("/jobs")
    ui.page.wait_for_url(re.compile(r"/login\?next=%2Fjobs$"))
    ui.expect_http(401, "/v1/me")
    field = ui.page.get_by_label("API key or provider token")
    field.fill("e2u_not-a-real-key")
    field.press("Enter")
    expect_text(ui, "#api-key-error", "unknown or revoked")
    assert field.get_attribute("aria-invalid") == "true"
    ui.shot("login")
    field.fill(key)
    field.press("Enter")
    ui.page.wait_for_url(re.compile(r"/jobs$"))
    expect_text(ui, "#who-name", r"alice \(user\)")
    assert ui.page.get_by_role("link", name="Admin").is_hidden()
    ui.page.get_by_role("button", name="Log out").click()
    ui.page.wait_for_url(re.compile(r"/login$"))
    assert ui.page.evaluate("sessionStorage.length") == 0
    ui.goto("/jobs/new")
    ui.page.wait_for_url(re.compile(r"/login\?next="))


def test_submit_job_form_shows_api_validation_errors(api, ui):
    key, alice = user_key(api)
    ui.login(key)
    ui.page.get_by_role("link", name="Submit a job").first.click()
    ui.page.wait_for_url(re.compile(r"/jobs/new$"))
    page = ui.page
    page.locator("#f-task option[value=arithmetic]").wait_for(state="attached")
    page.get_by_label("Name", exact=True).fill("from-the-form")
    page.get_by_label("Group size G").fill("1")  # the API requires G >= 2
    page.get_by_label("Prompts per step").fill("4")
    page.get_by_label("Max steps").fill("5")
    page.get_by_label("Prompts to generate").fill("20")
    ui.expect_http(422, "/v1/jobs")
    page.get_by_role("button", name="Submit job").click()
    expect_text(ui, "#f-group-error", "greater than or equal to 2")
    assert page.get_by_label("Group size G").get_attribute("aria-invalid") == "true"
    expect_text(ui, "#form-errors", "Group size G")
    ui.shot("submit-job")

    # a rule that spans fields (κ <= S + 1) has no single field: it is shown in the summary
    page.get_by_label("Group size G").fill("2")
    page.get_by_label("Staleness bound S").fill("0")
    page.get_by_label("Publish period κ").fill("2")
    page.get_by_role("button", name="Submit job").click()
    expect_text(ui, "#form-errors", r"publish_period \(κ=2\) must be <= staleness \+ 1")
    assert page.locator("#f-group-error").is_hidden()

    page.get_by_label("Publish period κ").fill("1")
    params = page.get_by_role("group", name="Ops")  # task parameters come from GET /v1/tasks
    params.get_by_label("+").check()
    params.get_by_label("*").check()
    page.get_by_role("button", name="Submit job").click()
    page.wait_for_url(re.compile(r"/jobs/[A-Za-z0-9_-]+$"))
    expect_text(ui, "#job-name", "from-the-form")
    job_id = page.url.rsplit("/", 1)[1]
    spec = ok(alice.get(f"/v1/jobs/{job_id}"))["spec"]
    assert spec["grpo"]["group_size"] == 2 and spec["grpo"]["prompts_per_step"] == 4
    assert spec["staleness"] == 0 and spec["max_steps"] == 5
    assert spec["task"] == {"name": "arithmetic", "params": {"ops": ["+", "*"]}}


def test_jobs_list_filters_by_status_and_name(api, ui):
    key, alice = user_key(api)
    new_job(alice, name="alpha-run")
    beta = new_job(alice, name="beta-run")
    new_job(alice, name="gamma-run", max_steps=7)
    ok(alice.post(f"/v1/jobs/{beta['id']}/cancel"))
    ui.login(key)
    rows = ui.page.locator("#jobs-table tbody tr")
    expect_text(ui, "#jobs-count", "of 3")
    expect_text(ui, "#jobs-table tbody tr", r"gamma-run.*0 / 7")
    # keyboard only: Tab from the top reaches the first job, the 2 s refresh keeps focus there, Enter opens it
    ui.page.keyboard.press("Tab")
    assert ui.page.evaluate("document.activeElement.textContent") == "Skip to content"
    for _ in range(20):
        ui.page.keyboard.press("Tab")
        if ui.page.evaluate("document.activeElement.textContent") == "gamma-run":
            break
    else:
        pytest.fail("Tab never reached the first job's link")
    ui.page.wait_for_timeout(2500)
    assert ui.page.evaluate("document.activeElement.textContent") == "gamma-run"
    ui.page.keyboard.press("Enter")
    ui.page.wait_for_url(re.compile(r"/jobs/job_"))
    expect_text(ui, "#job-name", "gamma-run")
    ui.page.go_back()
    ui.page.get_by_label("Status").select_option("cancelled")
    rows.filter(has_text="alpha-run").wait_for(state="detached")
    assert rows.count() == 1 and "beta-run" in rows.first.inner_text()
    ui.page.get_by_label("Status").select_option("")
    expect_text(ui, "#jobs-count", "of 3")
    ui.page.get_by_label("Name contains").fill("alp")
    rows.filter(has_text="gamma-run").wait_for(state="detached")
    assert rows.count() == 1 and "alpha-run" in rows.first.inner_text()
    assert ui.page.url.endswith("?name=alp")


def test_reward_chart_gains_points_as_the_job_trains(api, ui, training):
    job = training["job"]
    ui.login(training["key"])
    ui.goto(f"/jobs/{job['id']}")
    expect_text(ui, "#job-name", "reward-climb")
    ui.page.evaluate("window.__sameDocument = true")
    chart = ui.page.locator('figure[data-chart="reward"]')
    for step, reward in enumerate([0.2, 0.45, 0.7]):
        train_step(api, job, training["learner"], training["worker"], training["root"], step, reward)
        ui.page.locator(f'figure[data-chart="reward"][data-points="{step + 1}"]').wait_for()
    assert ui.page.evaluate("window.__sameDocument") is True  # updated in place, never reloaded
    assert re.search(r"3 points; at step 2: mean reward 0\.7", chart.locator(".plot").get_attribute("aria-label"))
    expect_text(ui, "#sum-step", "3 / 5")
    expect_text(ui, "#sum-reward", "0.7")
    for name in ("util", "rps", "kl", "mismatch", "cost"):
        ui.page.locator(f'figure[data-chart="{name}"][data-points="3"]').wait_for()
    mismatch = ui.page.locator('figure[data-chart="mismatch"] .plot').get_attribute("aria-label")
    assert re.search(r"at step 2: mismatch KL 0\.006, KL, fresh \(t − x = 0\) 0\.006, ESS 0\.79, clipped 0, "
                     r"masked 0\.1\.", mismatch), mismatch
    for step, greedy in ((0, 0.1), (3, 0.6)):  # the learner's held-out evaluations
        ok(training["learner"].post(f"/v1/jobs/{job['id']}/learner/evals", json={
            "step": step, "version": step, "prompts": 10, "greedy_accuracy": greedy, "sampled_accuracy": 0.5,
            "sampled_reward_mean": 0.5, "seconds": 1.0}))
    heldout = ui.page.locator('figure[data-chart="heldout"][data-points="2"]')
    heldout.wait_for()
    assert re.search(r"at step 3: greedy 60%", heldout.locator(".plot").get_attribute("aria-label"))
    ui.page.locator('figure[data-chart="staleness"][data-points="6"]').wait_for()
    expect_text(ui, "#versions-table tbody tr:first-child th", "^3$")
    assert ui.page.locator("#versions-table tbody tr").count() == 4
    expect_text(ui, "#versions-table tbody tr:first-child", r"1 · 1\s+\d+(\.\d+)? (ms|s)")  # its dissemination time
    expect_text(ui, "#versions-table tbody tr:first-child", r"\d+(\.\d+)? KB\s*\d+(\.\d+)? (KB|B)")  # full, delta
    expect_text(ui, "#versions-table tbody tr:nth-child(2)", "delta only")
    # S = 2 at step 3: no rollout can use version 0 any more, so its weights are gone and not offered
    expect_text(ui, "#versions-table tbody tr:last-child", "deleted")
    options = ui.page.locator("#ckpt-version option").all_inner_texts()
    assert not any(o.startswith("Version 0 ") for o in options) and any(o.startswith("Version 3 ") for o in options)
    assert not any(o.startswith("Version 2 ") for o in options)  # a delta only: nothing to download
    expect_text(ui, "#workers-table tbody tr", "rtx-1")
    expect_text(ui, "#rollouts li.rollout", "trained at step 2")
    ui.page.locator("#rollouts li.rollout summary").first.click()
    expect_text(ui, "#rollouts .completions", "reward 1")
    reconcile(api)  # the scheduler explains why rtx-1 serves this job
    expect_text(ui, "#decisions-table tbody tr", rf"rtx-1.*{training['worker_id']}")
    ui.shot("job")
    ui.page.get_by_role("link", name="Jobs").first.click()
    expect_text(ui, "#jobs-table tbody tr", r"reward-climb.*3 / 5.*0\.7")
    ui.shot("jobs")


def test_job_page_explains_activation_decisions(api, ui, tmp_path):
    key, alice = user_key(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "model"), name="explained",
                         grpo={"group_size": 2, "prompts_per_step": 2})
    _, provider = new_provider(api, "gpu-co")
    ids = {}
    # Unmeasured workers each count for at most a quarter of the need: the cheap one and three peers.
    for name, price in (("cheap", 0.1), *((f"peer{i}", 0.1) for i in range(3)), ("pricey", 9.0)):
        wid, worker = new_worker(api, provider, name, price_per_hour=price, rollouts_per_s=100.0)
        ok(worker.post(f"/v1/workers/{wid}/heartbeat", json={}))
        ids[name] = wid
    ui.login(key)
    ui.goto(f"/jobs/{job['id']}")
    expect_text(ui, "#decisions-table tbody td.empty", "No activation decision yet")
    ui.page.evaluate("window.__sameDocument = true")

    reconcile(api)  # a real tick: the solver activates the cheapest sufficient worker and says why
    decisions = ok(alice.get(f"/v1/jobs/{job['id']}/decisions"))
    cheap = next(d for d in decisions if d["worker_id"] == ids["cheap"] and d["action"] == "activated")
    row = ui.page.locator("#decisions-table tbody tr", has_text=ids["cheap"])
    row.wait_for()  # shown by the page's own polling, without a reload
    assert ui.page.evaluate("window.__sameDocument") is True
    cells = row.locator("td")
    assert cells.nth(1).inner_text() == "activated"
    assert cells.nth(1).locator(".badge.s-activated").count() == 1
    link = cells.nth(2).get_by_role("link", name="cheap")
    assert link.get_attribute("href") == f"/workers/{ids['cheap']}"
    assert cells.nth(3).inner_text() == cheap["line"] and cheap["line"].startswith(f"activated {ids['cheap']}: ")
    assert cells.nth(4).inner_text() == cheap["trigger"] == "first decision"
    assert cells.nth(0).locator("time").get_attribute("datetime") == cheap["created_at"]
    pricey = ui.page.locator("#decisions-table tbody tr", has_text=ids["pricey"])  # not picked, and why
    assert "qualifies but not needed" in pricey.inner_text() and pricey.locator(".badge.s-idle").count() == 1
    ui.audit()
    link.click()
    ui.page.wait_for_url(re.compile(rf"/workers/{ids['cheap']}$"))
    ui.check()


def test_decisions_are_inserted_as_text(api, ui, tmp_path):
    key, alice = user_key(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "model"))
    _, provider = new_provider(api, "gpu-co")
    wid, _ = new_worker(api, provider, name="w")
    markup = '<img src=x onerror="window.__pwned = 1"><b>bold</b>'
    with api.db.session() as session:
        session.add(Decision(job_id=job["id"], worker_id=wid, action="kept", line=markup, trigger=markup,
                             inputs={}))
        session.commit()
    ui.login(key)
    ui.goto(f"/jobs/{job['id']}")
    row = ui.page.locator("#decisions-table tbody tr", has_text="<b>bold</b>")
    row.wait_for()
    assert row.locator("img, b").count() == 0
    assert row.locator("td").nth(3).inner_text() == markup
    assert ui.page.evaluate("window.__pwned") is None


def test_open_a_worker_from_the_fleet(api, ui, training):
    wid = training["worker_id"]
    _, provider = new_provider(api, "peer-co")
    peer_id, peer = new_worker(api, provider, name="peer")
    activate(api, peer_id, training["job"]["id"])
    # a peer reports that chunks from rtx-1's relay failed verification: the trust flag goes up
    ok(peer.post(f"/v1/workers/{peer_id}/heartbeat",
                 json={"bad_sources": [{"url": "http://10.0.0.7:7070", "reason": "sha256 mismatch"}]}))
    ui.login(ADMIN_KEY)
    ui.page.get_by_role("link", name="Workers").click()
    ui.page.wait_for_url(re.compile(r"/workers$"))
    expect_text(ui, "#workers-count", "of 2")
    row = ui.page.locator("#workers-table tbody tr", has_text="rtx-1")
    assert "1 bad chunk" in row.inner_text() and "relay" in row.inner_text()
    assert "1 × RTX 4090 (24 GB)" in row.inner_text() and "$0.35" in row.inner_text()
    ui.shot("workers")
    row.get_by_role("link", name="rtx-1").click()
    ui.page.wait_for_url(re.compile(rf"/workers/{wid}$"))
    expect_text(ui, "#worker-hw", "RTX 4090")
    expect_text(ui, "#worker-work", r"Version held\s*0")
    expect_text(ui, "#worker-work", r"Scheduler\s*no decision yet")  # placed by hand here, not by the scheduler
    expect_text(ui, "#worker-net", "http://10.0.0.7:7070")
    expect_text(ui, "#worker-trust", "1 chunk")
    ui.shot("worker")


def test_cancel_a_job_after_confirming(api, ui, training):
    job = training["job"]
    ui.login(training["key"])
    ui.goto(f"/jobs/{job['id']}")
    cancel = ui.page.get_by_role("button", name="Cancel job")
    cancel.click()
    dialog = ui.page.get_by_role("dialog")
    dialog.get_by_role("button", name="Keep it").click()
    assert dialog.is_hidden()
    assert ok(training["alice"].get(f"/v1/jobs/{job['id']}"))["status"] == "running"
    cancel.click()
    dialog.get_by_role("button", name="Cancel job").click()
    expect_text(ui, "#job-status", "cancelled")
    expect_text(ui, "#job-reason", "cancelled by alice")
    assert cancel.is_hidden()
    assert ok(training["alice"].get(f"/v1/jobs/{job['id']}"))["status"] == "cancelled"


def test_the_cancel_dialog_says_which_versions_stay_downloadable(api, ui, training):
    """Cancelling ends the job, and retention keeps of an ended job's weights its newest version and every n-th one
    published in full with ECHO2_KEEP_VERSIONS_EVERY (0 here): the dialog said "its published versions stay
    downloadable" while every earlier version the page offered answered 410 once confirmed."""
    job, alice = training["job"], training["alice"]
    for step, reward in enumerate([0.3, 0.7, 0.4]):  # versions 1, 2 (a delta only) and 3 published
        train_step(api, job, training["learner"], training["worker"], training["root"], step, reward)
    offered = [v["version"] for v in ok(alice.get(f"/v1/jobs/{job['id']}/versions"))
               if v["available"] and v["total_size"] is not None]
    assert 1 in offered and 3 in offered, offered

    ui.login(training["key"])
    ui.goto(f"/jobs/{job['id']}")
    expect_text(ui, "#sum-version", "3")
    ui.page.locator('#ckpt-version option[value="1"]').wait_for(state="attached")
    ui.page.get_by_role("button", name="Cancel job").click()
    dialog = ui.page.get_by_role("dialog")
    promise = dialog.inner_text()
    assert "newest version (now 3) stays downloadable; earlier versions are deleted" in promise, promise
    dialog.get_by_role("button", name="Cancel job").click()
    expect_text(ui, "#job-status", "cancelled")

    checkpoint = f"/v1/jobs/{job['id']}/checkpoint"
    kept = [v for v in offered if alice.get(checkpoint, params={"version": v}).status_code == 200]
    assert kept == [3], f"the dialog said {promise!r}; after confirming, versions {kept} of the {offered} offered stay"


def test_a_paused_job_says_why_and_raising_its_budget_queues_it_again(api, ui, tmp_path):
    key, alice = user_key(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), budget_usd=0.5,
                         learner={"price_per_hour": 3600.0})
    bill_past_budget(api, job["id"])
    ui.login(key)
    ui.goto(f"/jobs/{job['id']}")
    expect_text(ui, "#job-status", "paused")
    expect_text(ui, "#job-reason", r"budget of \$0\.50 exhausted")
    ui.page.get_by_label("Budget ($)").fill("100")
    ui.page.get_by_role("button", name="Set budget").click()
    expect_text(ui, "#job-status", "queued")
    got = ok(alice.get(f"/v1/jobs/{job['id']}"))
    assert got["status"] == "queued" and got["spec"]["budget_usd"] == 100
    ui.audit()


def test_a_job_its_reward_paused_says_why_and_resumes_from_its_page(api, ui, tmp_path):
    key, alice = user_key(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    with api.db.session() as s:  # what commit_step does after reward_failures_to_pause unscored groups in a row
        pause_job(s, s.get_one(Job, job["id"]), "reward", "paused at step 0: 16 groups in a row could not be "
                  "scored by task arithmetic (last: http://x/ answered HTTP 503)")
        s.commit()
    ui.login(key)
    ui.goto(f"/jobs/{job['id']}")
    expect_text(ui, "#job-status", "paused")
    expect_text(ui, "#job-reason", "16 groups in a row could not be scored")
    ui.page.get_by_role("button", name="Resume job").click()
    expect_text(ui, "#job-status", "queued")
    assert ok(alice.get(f"/v1/jobs/{job['id']}"))["status"] == "queued"
    assert ui.page.get_by_role("button", name="Resume job").is_hidden()


def test_download_a_checkpoint(api, ui, training, tmp_path):
    job = training["job"]
    ui.login(training["key"])
    ui.goto(f"/jobs/{job['id']}")
    button = ui.page.get_by_role("button", name="Download checkpoint")
    ui.page.locator("#download:enabled").wait_for()
    with ui.page.expect_download() as info:
        button.click()
    download = info.value
    assert download.suggested_filename == f"{job['id']}-v0.tar"
    saved = tmp_path / "ckpt.tar"
    download.save_as(saved)
    with tarfile.open(saved) as tar:
        names = set(tar.getnames())
        assert {"model.safetensors", "config.json"} <= names
        data = tar.extractfile("model.safetensors").read()
    assert data == (training["folder"] / "model.safetensors").read_bytes()
    expect_text(ui, "#download-status", "Saved")


def test_provider_sees_workers_and_earnings(api, ui):
    body = ok(api.admin.post("/v1/providers", json={"name": "volunteer-lab", "contact": "ops@lab.example"}), 201)
    provider = api.client(body["token"])
    new_worker(api, provider, name="a100-box", gpu_model="A100", gpu_count=2, vram_gb=80, price_per_hour=1.8)
    new_worker(api, provider, name="laptop", gpu_model="cpu")
    ui.login(body["token"], expect_path="/provider")
    expect_text(ui, "#provider-name", "volunteer-lab")
    expect_text(ui, "#prov-earnings", r"\$0\.00")
    expect_text(ui, "#prov-workers", "2")
    expect_text(ui, "#workers-table tbody", "a100-box")
    assert ui.page.get_by_role("link", name="Jobs").is_hidden()
    ui.shot("provider")


def test_the_provider_page_shows_its_live_workers_after_many_restarts(api, ui):
    """`echo2-worker join` deregisters its worker when it stops and registers a new one when it starts again, so a
    provider that restarts its machines piles up deregistered rows (listed oldest first). The page asked for one
    page of 500 and left out the deregistered ones in the browser: its live machines were not on it at all."""
    body = ok(api.admin.post("/v1/providers", json={"name": "restart-lab"}), 201)
    provider = api.client(body["token"])
    template_id, _ = new_worker(api, provider, name="old-run")
    with api.db.session() as s:  # 500 earlier runs of its machines, each deregistered when it stopped
        t = s.get_one(Worker, template_id)
        skip = {"id", "created_at", "status", "name", "audit_salt"}
        cols = {c.key: getattr(t, c.key) for c in Worker.__table__.columns if c.key not in skip}
        start = utcnow() - timedelta(days=60)
        s.add_all(Worker(**cols, name=f"old-run-{i}", status="deregistered", created_at=start + timedelta(minutes=i))
                  for i in range(500))
        s.get_one(Worker, template_id).status = "deregistered"
        s.commit()
    # Today's machine: registered and working for a job.
    _, alice = new_user(api)
    job = new_job(alice)
    live_id, _ = new_worker(api, provider, name="rtx-today", price_per_hour=0.4)
    activate(api, live_id, job["id"])
    with api.db.session() as s:
        s.get_one(Worker, live_id).status = "active"
        s.commit()
    me = ok(provider.get("/v1/providers/me"))
    assert me["num_workers"] == 1

    ui.login(body["token"], expect_path="/provider")
    expect_text(ui, "#prov-workers", "1")
    ui.page.wait_for_timeout(500)
    table = ui.page.locator("#workers-table tbody").inner_text()
    active = ui.page.locator("#prov-active").inner_text()
    price = ui.page.locator("#prov-price").inner_text()
    assert "rtx-today" in table and active == "1" and price.startswith("$0.40"), (
        f"the API says 1 live worker (rtx-today, active at $0.40/h); the page shows table {table!r}, "
        f"active now {active!r}, fleet price {price!r}")


def test_admin_creates_a_user_and_revokes_a_token(api, ui):
    _, bob = user_key(api, "bob")
    ui.login(ADMIN_KEY)
    ui.page.get_by_role("link", name="Admin").click()
    ui.page.wait_for_url(re.compile(r"/admin$"))
    expect_text(ui, "#users-table tbody", "bob")
    ui.expect_http(422, "/v1/users")
    ui.page.get_by_role("button", name="Create user").click()  # empty name: the API says why
    expect_text(ui, "#u-name-error", "at least 1 character")
    ui.page.get_by_label("New user's name").fill("carol")
    ui.page.get_by_role("button", name="Create user").click()
    expect_text(ui, "#secret-what", "User carol created")
    carol_key = ui.page.get_by_label("Shown once: copy it now").input_value()
    assert ok(api.client(carol_key).get("/v1/me"))["name"] == "carol"
    ui.shot("admin")
    bob_row = ui.page.locator("#tokens-table tbody tr", has_text="bob")
    bob_row.get_by_role("button", name=re.compile("Revoke user token")).click()
    ui.page.get_by_role("dialog").get_by_role("button", name="Revoke").click()
    bob_row.wait_for(state="detached")
    assert bob.get("/v1/me").status_code == 401
    ui.page.get_by_label("Include revoked").check()
    expect_text(ui, "#tokens-table tbody tr", "bob")


def test_refused_pages_say_why(api, ui):
    key, _ = user_key(api)
    ui.login(key)
    ui.goto("/admin")
    expect_text(ui, "#page-error", "Only admins can use this page")
    assert not ui.page.locator("#user-form").is_visible()  # no forms that could only answer 403
    ui.expect_http(404, "/v1/jobs/job_missing")
    ui.goto("/jobs/job_missing")
    expect_text(ui, "#page-error", "Not found")
    provider = ok(api.admin.post("/v1/providers", json={"name": "p"}), 201)["token"]
    ui.page.get_by_role("button", name="Log out").click()
    ui.login(provider, expect_path="/provider")
    ui.expect_http(403, "/v1/jobs")
    ui.goto("/jobs")
    expect_text(ui, "#page-error", "cannot see this page: this route needs")


def test_polling_pauses_while_the_tab_is_hidden(api, ui):
    key, _ = user_key(api)
    calls: list[str] = []
    ui.page.on("request", lambda r: "/v1/jobs?" in r.url and calls.append(r.url))
    ui.login(key)
    deadline = time.monotonic() + 15
    while len(calls) < 2 and time.monotonic() < deadline:  # the list polls every 2 s
        ui.page.wait_for_timeout(200)
    assert len(calls) >= 2
    ui.page.evaluate("""() => {
        Object.defineProperty(document, "hidden", {configurable: true, get: () => true});
        Object.defineProperty(document, "visibilityState", {configurable: true, get: () => "hidden"});
        document.dispatchEvent(new Event("visibilitychange"));
    }""")
    ui.page.wait_for_timeout(300)
    before = len(calls)
    ui.page.wait_for_timeout(4500)
    assert len(calls) == before
    ui.page.evaluate("""() => {
        Object.defineProperty(document, "hidden", {configurable: true, get: () => false});
        Object.defineProperty(document, "visibilityState", {configurable: true, get: () => "visible"});
        document.dispatchEvent(new Event("visibilitychange"));
    }""")
    ui.page.wait_for_timeout(1000)
    assert len(calls) > before  # resumes at once when visible again


def test_pages_fit_a_phone(api, browser, api_routes, training):
    for step, reward in enumerate([0.3, 0.6]):
        train_step(api, training["job"], training["learner"], training["worker"], training["root"], step, reward)
    reconcile(api)
    context, ui = open_dashboard(browser, api, api_routes, viewport={"width": 390, "height": 844},
                                 is_mobile=True, has_touch=True, device_scale_factor=2)
    try:
        ui.login(training["key"])
        expect_text(ui, "#jobs-table tbody", "reward-climb")
        for path, ready in [("/jobs", "#jobs-table tbody a"), (f"/jobs/{training['job']['id']}", "#job-name"),
                            ("/jobs/new", "#f-task option"), ("/workers", "#workers-table tbody a")]:
            ui.goto(path)
            ui.page.locator(ready).first.wait_for(state="attached")
            ui.page.wait_for_timeout(200)
            overflow = ui.page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 1, f"{path} scrolls sideways on a phone by {overflow}px"
        ui.goto(f"/jobs/{training['job']['id']}")
        ui.page.locator('figure[data-chart="reward"][data-points="2"]').wait_for()
        expect_text(ui, "#decisions-table tbody tr", "activated")
        overflow = ui.page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 1, f"the job page with decisions scrolls sideways on a phone by {overflow}px"
        ui.shot("job-phone")
    finally:
        close_dashboard(context, ui)
    ui.check()


def test_the_jobs_table_fits_a_laptop_and_tinker_samplers_are_shown_on_request(api, browser, api_routes, tmp_path):
    from tests.scheduler.test_reconcile import idle_tinker_model

    key, alice = user_key(api)
    folder = fake_model_folder(tmp_path / "models" / "SmolLM2-135M-Instruct-converted-from-gguf-for-a-long-run")
    new_job(alice, name="a-rather-long-job-name-that-says-what-this-run-is-about-v2", base_model=str(folder))
    idle_tinker_model(api, tmp_path, alice)
    context, ui = open_dashboard(browser, api, api_routes, viewport={"width": 1280, "height": 800})
    try:
        ui.login(key)
        expect_text(ui, "#jobs-count", "of 1")
        rows = ui.page.locator("#jobs-table tbody tr")
        assert rows.count() == 1 and "Tinker sampler" not in rows.first.inner_text()
        cut = ui.page.evaluate("(w => w.scrollWidth - w.clientWidth)(document.querySelector('.table-wrap'))")
        assert cut <= 1, f"the jobs table is cut off by {cut}px at 1280 px"
        ui.page.get_by_label("Show Tinker samplers").check()
        expect_text(ui, "#jobs-count", "of 2")
        expect_text(ui, "#jobs-table tbody tr", "Tinker sampler of")
        assert ui.page.url.endswith("?tinker=true")
        sampler = ui.page.locator("#jobs-table tbody tr", has_text="Tinker sampler of")
        assert "checkpoint" in sampler.inner_text() and "100000" not in sampler.inner_text()  # no steps of its own
        sampler.get_by_role("link").click()
        expect_text(ui, "#sum-step", "sampling checkpoint")
        assert not ui.page.locator("#sum-progress").is_visible()
    finally:
        close_dashboard(context, ui)
    ui.check()
