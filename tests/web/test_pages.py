"""The dashboard's HTML shells and assets as served by the control plane (no browser needed)."""

from __future__ import annotations

import re

import pytest

from web import STATIC

PAGES = ["/login", "/jobs", "/jobs/new", "/jobs/job_123", "/jobs/job_123/steps/4", "/workers", "/workers/w-1",
         "/provider", "/admin"]


@pytest.mark.parametrize("path", PAGES)
def test_pages_are_html_shells_with_a_strict_policy(api, path):
    r = api.client().get(path)  # no token: the shell holds no data, the browser fetches it with the key
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    assert '<html lang="en">' in r.text and "<h1" in r.text and 'name="viewport"' in r.text
    for asset in re.findall(r'(?:src|href)="(/static/[^"?]+)', r.text):
        assert api.client().get(asset).status_code == 200, asset


def test_root_redirects_to_jobs(api):
    r = api.client().get("/", follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"] == "/jobs"


def test_ids_in_page_paths_are_checked(api):
    assert api.client().get("/jobs/not%20an%20id").status_code == 422
    assert api.client().get("/workers/" + "x" * 65).status_code == 422


def test_pages_stay_out_of_the_api_schema(api):
    paths = api.admin.get("/openapi.json").json()["paths"]
    pages = {"/", "/login", "/jobs", "/jobs/new", "/jobs/{job_id}", "/jobs/{job_id}/steps/{step}",
             "/workers", "/workers/{worker_id}", "/provider",
             "/admin"}
    assert not pages & set(paths) and not any(p.startswith("/static") for p in paths)


def test_static_files_are_served_and_versioned(api):
    page = api.client().get("/jobs").text
    version = re.search(r"/static/echo2\.js\?v=([0-9a-f]{12})", page)
    assert version is not None
    for name in ("echo2.js", "uPlot.iife.min.js", "uPlot.min.css", "style.css", "favicon.svg"):
        r = api.client().get(f"/static/{name}")
        assert r.status_code == 200 and r.content == (STATIC / name).read_bytes()
    assert api.client().get("/static/../__init__.py").status_code == 404


def test_scripts_never_inject_html():
    """API data (worker completions, names) must reach the page as text, never as markup."""
    for script in STATIC.glob("*.js"):
        if script.name.startswith("uPlot"):
            continue
        text = script.read_text()
        assert not re.search(r"\.(innerHTML|outerHTML)\s*=|insertAdjacentHTML|document\.write", text), script.name
