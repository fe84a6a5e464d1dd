"""The control plane as a PEP 503 package index of its own echo2 and echo2-worker wheels, and the version a
worker checks at join; pip itself installing from it is tests/workers/test_e2e_worker.py."""

from __future__ import annotations

import hashlib
import re
import zipfile
from io import BytesIO

import echo2
import pytest
from echo2_worker.cli import check_version
from echo2_worker.control import ControlPlane

from api.services.packages import VERSION
from tests.conftest import Api


def test_the_index_lists_both_projects_with_their_wheels_and_hashes(api: Api) -> None:
    anonymous = api.client()
    root = anonymous.get("/simple/")
    assert root.status_code == 200 and root.headers["content-type"].startswith("text/html")
    assert re.findall(r'href="([^"]+)"', root.text) == ["echo2/", "echo2-worker/"]
    for project, dist in (("echo2", "echo2"), ("echo2-worker", "echo2_worker")):
        page = anonymous.get(f"/simple/{project}/")
        assert page.status_code == 200
        href, = re.findall(r'href="([^"]+)"', page.text)
        assert 'data-requires-python="&gt;=3.11"' in page.text
        url, digest = href.split("#sha256=")
        assert url == f"/simple/files/{dist}-{VERSION}-py3-none-any.whl"
        wheel = anonymous.get(url)
        assert wheel.status_code == 200 and hashlib.sha256(wheel.content).hexdigest() == digest
        with zipfile.ZipFile(BytesIO(wheel.content)) as z:
            metadata = z.read(f"{dist}-{VERSION}.dist-info/METADATA").decode()
        assert f"Name: {project}\n" in metadata and f"Version: {VERSION}\n" in metadata


def test_names_are_normalised_and_other_projects_go_upstream_or_nowhere(api: Api,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    anonymous = api.client()
    moved = anonymous.get("/simple/Echo2_Worker/", follow_redirects=False)
    assert moved.status_code == 301 and moved.headers["location"] == "/simple/echo2-worker/"
    assert anonymous.get("/simple/echo2", follow_redirects=False).headers["location"] == "/simple/echo2/"
    upstream = anonymous.get("/simple/Torch/", follow_redirects=False)
    assert upstream.status_code == 307 and upstream.headers["location"] == "https://pypi.org/simple/torch/"
    monkeypatch.setattr(api.server.settings, "package_upstream", "")
    missing = anonymous.get("/simple/torch/")
    assert missing.status_code == 404 and "serves only echo2 and echo2-worker, not torch" in missing.json()["detail"]
    assert anonymous.get("/simple/files/evil-1.0-py3-none-any.whl").status_code == 404
    assert anonymous.get("/simple/files/..%2Fapi.key").status_code in (404, 422)


def test_version_says_where_to_install_from_and_a_worker_of_another_version_is_told_what_to_run(
        api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    body = api.client().get("/v1/version").json()
    assert body == {"version": VERSION, "packages": {"echo2": VERSION, "echo2-worker": VERSION},
                    "index_url": f"{api.url}/simple"}
    control = ControlPlane(api.url)
    try:
        check_version(control, api.url, "transformers")  # the same version: joins
        monkeypatch.setattr(echo2, "__version__", "0.0.9")
        with pytest.raises(ValueError) as refused:
            check_version(control, api.url, "vllm")
    finally:
        control.close()
    assert str(refused.value) == (
        f"this machine has echo2 0.0.9, but {api.url} runs Echo2 {VERSION}: install its version with  pip install "
        f"--upgrade --index-url {api.url}/simple 'echo2-worker[vllm]=={VERSION}' 'echo2=={VERSION}'")
