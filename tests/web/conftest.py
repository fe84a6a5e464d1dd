"""Browser fixtures: Debian Chromium driven by Playwright (sync API) against the live `api` control plane.

Without /usr/bin/chromium (or the playwright package) the browser tests skip with the reason; under CI=true
that is a failure, since the test script installs both. Every page's console errors, uncaught exceptions,
failed requests and HTTP errors are collected and fail the test unless it declared them expected.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Api

CHROMIUM = Path(os.environ.get("ECHO2_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOTS = Path(os.environ.get("ECHO2_SCREENSHOTS", Path(__file__).resolve().parents[2] / "docs" / "screenshots"))
TIMEOUT_MS = 15_000

# Structural accessibility checks run on every page a test screenshots: labels, names, headings, ids.
A11Y_AUDIT = """() => {
  const problems = [];
  const visible = (el) => !!(el.offsetWidth || el.offsetHeight || el.getClientRects().length);
  const named = (el) => (el.getAttribute("aria-label") || "").trim() || el.getAttribute("aria-labelledby")
    || (el.textContent || "").trim() || el.getAttribute("title");
  if (!document.documentElement.lang) problems.push("html has no lang");
  if (!document.title.trim()) problems.push("page has no title");
  const h1s = [...document.querySelectorAll("h1")].filter(visible);
  if (h1s.length !== 1) problems.push(`expected one visible h1, found ${h1s.length}`);
  let last = 0;
  for (const hd of [...document.querySelectorAll("h1,h2,h3,h4,h5,h6")].filter(visible)) {
    const level = Number(hd.tagName[1]);
    if (last && level > last + 1) problems.push(`heading level skips from h${last} to h${level}: ${hd.textContent}`);
    last = level;
  }
  for (const el of document.querySelectorAll("input:not([type=hidden]), select, textarea")) {
    if (!visible(el)) continue;
    const label = el.id && document.querySelector(`label[for="${CSS.escape(el.id)}"]`);
    if (!label && !el.closest("label") && !el.getAttribute("aria-label") && !el.getAttribute("aria-labelledby")) {
      problems.push(`control without a label: ${el.outerHTML.slice(0, 80)}`);
    }
  }
  for (const el of document.querySelectorAll("button, a[href], summary, [role=img]")) {
    if (visible(el) && !named(el)) problems.push(`no accessible name: ${el.outerHTML.slice(0, 80)}`);
  }
  const ids = [...document.querySelectorAll("[id]")].map((e) => e.id);
  for (const id of new Set(ids.filter((id, i) => ids.indexOf(id) !== i))) problems.push(`duplicate id ${id}`);
  for (const table of document.querySelectorAll("table")) {
    if (visible(table) && !table.querySelector("th")) problems.push(`table without headers: ${table.id}`);
  }
  return problems;
}"""


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must run the browser tests (the test script installs chromium and playwright)")
    pytest.skip(reason)


# Module scope, not session: the sync Playwright API keeps an asyncio loop running in the main thread
# while it is open, which would break every later test that calls asyncio.run().
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is not installed (pip install playwright)")
    if not CHROMIUM.exists():
        _unavailable(f"{CHROMIUM} not found (apt-get install chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def api_routes(live_server: Any) -> list[tuple[str, re.Pattern[str]]]:
    """Every (method, path regex) of the public API, from its OpenAPI document."""
    routes = []
    for path, ops in live_server.app.openapi()["paths"].items():
        regex = re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(path)) + "$")
        routes.extend((method.upper(), regex) for method in ops)
    return routes


@dataclass
class Dashboard:
    """A browser tab on the dashboard, with what went wrong in it."""

    page: Any
    api: Api
    routes: list[tuple[str, re.Pattern[str]]]
    problems: list[str] = field(default_factory=list)
    expected: list[tuple[int, str]] = field(default_factory=list)
    api_calls: set[tuple[str, str]] = field(default_factory=set)
    in_flight: set[Any] = field(default_factory=set)
    closing: bool = False

    def goto(self, path: str) -> None:
        self.page.goto(self.api.url + path)

    def login(self, key: str, expect_path: str = "/jobs") -> None:
        self.goto("/login")
        self.page.get_by_label("API key or provider token").fill(key)
        self.page.get_by_role("button", name="Log in").click()
        self.page.wait_for_url(re.compile(re.escape(self.api.url + expect_path) + r"(\?.*)?$"))

    def expect_http(self, status: int, path_part: str) -> None:
        """Declare an HTTP error the test provokes on purpose (e.g. a 422 from a bad form value)."""
        self.expected.append((status, path_part))

    def audit(self) -> None:
        problems = self.page.evaluate(A11Y_AUDIT)
        assert not problems, f"accessibility problems on {self.page.url}:\n" + "\n".join(problems)

    def shot(self, name: str, full_page: bool = True) -> None:
        """Check the page's structure, then save its screenshot to docs/screenshots/<name>.png."""
        self.audit()
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=full_page, animations="disabled")

    def _is_expected(self, status: int, url: str) -> bool:
        return any(status == s and part in url for s, part in self.expected)

    def on_console(self, msg: Any) -> None:
        if msg.type != "error" or self.closing:
            return
        url = (msg.location or {}).get("url", "")
        m = re.search(r"status of (\d{3})", msg.text)
        if m and self._is_expected(int(m.group(1)), url):
            return
        self.problems.append(f"console error: {msg.text} ({url})")

    def on_response(self, response: Any) -> None:
        url = response.url
        if url.startswith(self.api.url + "/v1/"):
            path = url[len(self.api.url):].split("?")[0]
            method = response.request.method
            self.api_calls.add((method, path))
            if not any(m == method and rx.match(path) for m, rx in self.routes):
                self.problems.append(f"the page called {method} {path}, which is not an API route")
        if response.status >= 400 and not self._is_expected(response.status, url):
            self.problems.append(f"HTTP {response.status} for {response.request.method} {url}")

    def on_request_failed(self, request: Any) -> None:
        self.in_flight.discard(request)
        failure = request.failure or ""
        if self.closing:
            return
        if "ERR_ABORTED" in failure:  # a poll cut short by navigating away, not an error
            return
        self.problems.append(f"request failed: {request.method} {request.url}: {failure}")

    def check(self) -> None:
        assert not self.problems, "problems in the browser:\n" + "\n".join(self.problems)


def close_dashboard(context: Any, ui: Dashboard) -> None:
    """Stop the page's polling and let requests already at the server finish, then close the browser context.

    The next test wipes the database; a request still running then (e.g. on PostgreSQL, holding a lock that
    TRUNCATE needs) would deadlock with it. New API calls are refused in the browser, never sent.
    """
    ui.closing = True
    context.route("**/v1/**", lambda route: route.abort())
    for _ in range(100):
        if not ui.in_flight:
            break
        ui.page.wait_for_timeout(50)
    context.close()


def open_dashboard(browser: Any, api: Api, routes: list[tuple[str, re.Pattern[str]]],
                   **context_args: Any) -> tuple[Any, Dashboard]:
    context = browser.new_context(accept_downloads=True, **context_args)
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    ui = Dashboard(page=page, api=api, routes=routes)
    page.on("console", ui.on_console)
    page.on("pageerror", lambda exc: ui.problems.append(f"uncaught exception: {exc}"))
    page.on("response", ui.on_response)
    page.on("requestfailed", ui.on_request_failed)
    page.on("request", lambda request: ui.in_flight.add(request))
    page.on("requestfinished", lambda request: ui.in_flight.discard(request))
    return context, ui


@pytest.fixture
def ui(browser: Any, api: Api, api_routes: list[tuple[str, re.Pattern[str]]]) -> Iterator[Dashboard]:
    """A fresh browser context (empty sessionStorage) on a clean control plane; closed before the API is wiped."""
    context, dashboard = open_dashboard(browser, api, api_routes, viewport={"width": 1366, "height": 900})
    yield dashboard
    close_dashboard(context, dashboard)
    dashboard.check()
