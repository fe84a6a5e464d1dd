"""The rollout trace page in the browser: a step's groups token by token, coloured by version, then by mismatch
between the worker's logprob of each token and the learner's."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from api.models import Job
from api.services import retention
from tests.factories import ok, traced_step


def test_a_steps_groups_are_shown_token_by_token_and_coloured(api, ui, tiny_model_dir):
    jid, ids, _, key = traced_step(api, tiny_model_dir)
    ui.login(key)
    ui.goto(f"/jobs/{jid}")
    ui.page.get_by_role("link", name="Rollout traces of the latest step, token by token").click()
    ui.page.wait_for_url(f"{api.url}/jobs/{jid}/steps/0")
    first = ui.page.locator(f"#rollout-{ids[0]}")
    first.wait_for()
    assert ui.page.locator(".trace-group").count() == 2
    assert "2 groups trained at step 0" in ui.page.locator("#trace-count").inner_text()
    assert "traced-worker" in first.inner_text() and "probation" in first.inner_text()
    assert "passed" in first.inner_text()  # the audit's verdict
    tokens = first.locator(".sample").first.locator(".tok")
    assert tokens.count() == 3
    assert [tokens.nth(k).get_attribute("data-version") for k in range(3)] == ["0", "0", "0"]
    # By version: a token of the step's own version is green.
    assert tokens.nth(1).evaluate("el => getComputedStyle(el).backgroundColor") == "rgb(218, 251, 225)"
    assert "learner logprob -0.75" in tokens.nth(1).get_attribute("title")

    ui.page.get_by_label("Colour tokens by").select_option("mismatch")
    assert tokens.nth(1).get_attribute("data-mismatch") == "0.2500"
    assert tokens.nth(1).evaluate("el => getComputedStyle(el).backgroundColor") == "rgba(207, 34, 46, 0.25)"
    assert tokens.nth(0).evaluate("el => getComputedStyle(el).backgroundColor") == "rgba(207, 34, 46, 0)"
    untraced = ui.page.locator(f"#rollout-{ids[1]} .tok").first
    assert untraced.get_attribute("data-mismatch") == ""  # its learner logprobs did not fit: not coloured
    assert "Next step" not in [a.inner_text() for a in ui.page.locator("#trace-controls a:visible").all()]
    ui.shot("trace")


def test_a_job_whose_tokens_retention_deleted_says_so_where_they_were(api, ui, tiny_model_dir):
    """ECHO2_ARCHIVE_KEEP_DAYS after it ended, a job's tokens are gone (410): its page still shows the job, with
    the reason in place of its rollouts, and its trace page says the same instead of failing."""
    jid, _, alice, key = traced_step(api, tiny_model_dir)
    ok(alice.post(f"/v1/jobs/{jid}/cancel"))
    settings = api.server.settings.model_copy(update={"archive_after_h": 0.0, "archive_keep_days": 1.0})

    def sweep() -> None:  # in a thread of its own: the browser's driver holds this one's event loop
        state = api.server.app.state
        with ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, retention.sweep_periodically(api.db, state.blobs, state.checkpoints,
                                                                  settings)).result()

    sweep()  # archived
    with api.db.session() as db:
        db.get(Job, jid).finished_at -= timedelta(days=2)
        db.commit()
    sweep()  # and deleted
    assert alice.get(f"/v1/jobs/{jid}/rollouts").status_code == 410
    ui.expect_http(410, f"/v1/jobs/{jid}/rollouts")
    ui.expect_http(410, f"/v1/jobs/{jid}/traces")
    ui.login(key)
    ui.goto(f"/jobs/{jid}")
    gone = ui.page.locator("#rollouts li.empty")
    gone.wait_for()
    assert "were deleted by retention on" in gone.inner_text()
    assert ui.page.locator("#page-error").is_hidden()
    ui.goto(f"/jobs/{jid}/steps/0")
    ui.page.locator("#trace-count", has_text="were deleted by retention on").wait_for()
    assert ui.page.locator(".trace-group").count() == 0 and ui.page.locator("#page-error").is_hidden()
