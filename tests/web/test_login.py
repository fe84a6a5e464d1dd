"""The login page, as a phishing link or a slow network would try it (real browser)."""

from __future__ import annotations

import contextlib
import re
from typing import Any
from urllib.parse import urlparse

import pytest

from tests.web.conftest import close_dashboard, open_dashboard
from tests.web.test_dashboard import user_key

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("next_param", ["/%5Cevil.example/relogin", "/%09/evil.example/relogin"])
def test_login_never_redirects_off_site(api, ui, next_param):
    """`next` must be a path of this site: "/\\host" and "/<TAB>/host" passed a check for "//" but browsers read
    them as "//host", so a link to the real login page sent the user, key just pasted, to an attacker's page."""
    key, _ = user_key(api)
    ui.page.context.route("http://evil.example/**", lambda route: route.fulfill(
        status=200, content_type="text/html", body="<h1>Session expired: paste your API key again</h1>"))
    ui.goto("/login?next=" + next_param)
    ui.page.get_by_label("API key or provider token").fill(key)
    ui.page.get_by_role("button", name="Log in").click()
    ui.page.wait_for_url(lambda url: "/login" not in url)
    assert urlparse(ui.page.url).hostname == "127.0.0.1" and urlparse(ui.page.url).path == "/jobs"


def test_the_login_form_never_puts_the_key_in_a_url(api, browser, api_routes):
    """Submitted before the deferred script attached its handler (a slow network, a blocked script), the form
    sent GET /login?key=<the key>: into history and access logs. Its field has no name now."""
    key, _ = user_key(api)
    context, ui = open_dashboard(browser, api, api_routes)
    held: list[Any] = []
    urls: list[str] = []
    ui.page.on("request", lambda request: urls.append(request.url))

    def slow_script(route: Any) -> None:
        if not held:
            held.append(route)  # the first load of the script is slow: answered after the submit
        else:
            route.continue_()

    try:
        context.route(re.compile(r".*/static/echo2\.js.*"), slow_script)
        ui.page.goto(api.url + "/login", wait_until="commit")
        field = ui.page.locator("#api-key")
        field.fill(key)
        field.press("Enter")
        ui.page.wait_for_timeout(1000)
        for route in held:
            with contextlib.suppress(Exception):  # the page it was for is gone
                route.continue_()
        ui.page.wait_for_timeout(500)
        assert [u for u in urls + [ui.page.url] if key in u] == []
    finally:
        close_dashboard(context, ui)
