"""The package index (PEP 503 simple API) a provider installs the worker from, and the version workers check
at join (api/services/packages.py). Public: what it serves is the platform's own open code."""

from __future__ import annotations

from typing import Annotated

from echo2.protocol import PlatformVersion
from fastapi import Path, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response

from ..errors import ApiError
from ..routing import make_router
from ..services import packages
from ..services.packages import WheelIndex

router = make_router(tags=["packages"])
ProjectPath = Annotated[str, Path(max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]
FilePath = Annotated[str, Path(max_length=200, pattern=r"^[A-Za-z0-9._-]+\.whl$")]
FILES = "/simple/files"


def _index(request: Request) -> WheelIndex:
    return request.app.state.wheels


def _wheels(request: Request) -> dict[str, packages.Wheel]:
    """The wheels; the first request after start waits for them to be built (seconds)."""
    index = _index(request)
    wheels = index.wait(packages.BUILD_TIMEOUT_S)
    if wheels is None:
        if index.error is not None:
            raise ApiError(503, f"this control plane serves no wheels: {index.error}")
        raise ApiError(503, "the wheels are still being built; try again shortly", headers={"Retry-After": "10"})
    return wheels


@router.get("/v1/version", operation_id="get_version",
            summary="The platform's version and where its packages install from (no token needed)")
def version(request: Request) -> PlatformVersion:
    url = request.app.state.settings.public_url
    return PlatformVersion(version=packages.VERSION, packages={p: packages.VERSION for p in packages.PROJECTS},
                           index_url=f"{url}/simple")


@router.get("/simple/", include_in_schema=False)
def simple_root(request: Request) -> HTMLResponse:
    _wheels(request)
    return HTMLResponse(packages.root_page())


@router.get("/simple", include_in_schema=False)
def simple_root_slash() -> RedirectResponse:
    return RedirectResponse("/simple/", status_code=301)


@router.get("/simple/{project}", include_in_schema=False)
def simple_project_slash(project: ProjectPath) -> RedirectResponse:
    return RedirectResponse(f"/simple/{project}/", status_code=301)


@router.get("/simple/{project}/", include_in_schema=False)
def simple_project(project: ProjectPath, request: Request) -> Response:
    name = packages.normalize(project)
    if name not in packages.PROJECTS:
        upstream = request.app.state.settings.package_upstream.rstrip("/")
        if not upstream:
            raise ApiError(404, f"this index serves only {' and '.join(packages.PROJECTS)}, not {name}")
        return RedirectResponse(f"{upstream}/{name}/", status_code=307)
    if project != name:
        return RedirectResponse(f"/simple/{name}/", status_code=301)
    return HTMLResponse(packages.project_page(_wheels(request)[name], FILES))


@router.get(FILES + "/{filename}", include_in_schema=False)
def wheel_file(filename: FilePath, request: Request) -> FileResponse:
    for wheel in _wheels(request).values():
        if wheel.path.name == filename:
            return FileResponse(wheel.path, media_type="application/octet-stream", filename=filename)
    raise ApiError(404, f"no wheel {filename} here")
