"""The rollout trace page in the browser: a step's groups token by token, coloured by version, then by mismatch
between the worker's logprob of each token and the learner's."""

from __future__ import annotations

from tests.factories import traced_step


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
