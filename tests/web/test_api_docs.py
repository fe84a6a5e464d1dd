"""The interactive API docs (/docs, /redoc) in a browser that may reach nothing but the control plane: their
scripts and styles are served by it, not by a CDN (a control plane on a private network has none)."""

from __future__ import annotations

from typing import Any


def _offline_page(browser: Any, api: Any) -> tuple[Any, Any, list[str]]:
    """A page whose requests anywhere but the control plane fail, and a list of those it needs (all but images:
    ReDoc's footer shows Redocly's logo from their CDN, a broken image offline) and of its uncaught errors."""
    context = browser.new_context()
    problems: list[str] = []

    def only_here(route: Any) -> None:
        if route.request.url.startswith(api.url):
            route.continue_()
        else:
            if route.request.resource_type != "image":
                problems.append(f"requested {route.request.url}")
            route.abort()

    context.route("**/*", only_here)
    page = context.new_page()
    page.on("pageerror", lambda exc: problems.append(f"uncaught: {exc}"))
    return context, page, problems


def test_swagger_ui_renders_every_route_from_this_server_alone(browser, api):
    context, page, problems = _offline_page(browser, api)
    try:
        page.goto(f"{api.url}/docs")
        page.wait_for_selector(".opblock", timeout=20_000)
        paths = page.locator(".opblock-summary-path").all_inner_texts()
        assert any("/v1/workers/{worker_id}/heartbeat" in p.replace("\u200b", "") for p in paths), paths[:5]
        assert len(paths) == sum(len(ops) for ops in api.server.app.openapi()["paths"].values())
    finally:
        context.close()
    assert not problems, problems


def test_redoc_renders_from_this_server_alone(browser, api):
    context, page, problems = _offline_page(browser, api)
    try:
        page.goto(f"{api.url}/redoc")
        page.wait_for_selector("h1", timeout=20_000)
        assert page.locator("h1").first.inner_text().startswith("Echo2")
        assert page.locator("[data-section-id]").count() > 20  # a section per operation and schema
    finally:
        context.close()
    assert not problems, problems
