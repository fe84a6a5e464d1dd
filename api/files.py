"""File responses: chunk downloads whose Range errors answer like every other error, not as Starlette's plain
text, and streams that release what they read once they are done, however they end."""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import FileResponse, MalformedRangeHeader, RangeNotSatisfiable, StreamingResponse
from starlette.types import Receive, Scope, Send

from .errors import ApiError


class RangedFileResponse(FileResponse):
    """A FileResponse that ignores a Range header it cannot parse, as RFC 9110 §14.2 allows (Starlette
    answers 400 text/plain), and refuses one starting past the end with a problem+json 416."""

    @classmethod
    def _parse_range_header(cls, http_range: str, file_size: int) -> list[tuple[int, int]]:
        try:
            return super()._parse_range_header(http_range, file_size)
        except MalformedRangeHeader:
            return []  # no ranges: the whole file, 200
        except RangeNotSatisfiable as exc:
            raise ApiError(416, f"the range starts past the end of the {exc.max_size} bytes", field="Range",
                           headers={"Content-Range": f"bytes */{exc.max_size}"}) from None


class ReleasingStream(StreamingResponse):
    """A StreamingResponse that calls `release` once it is done: sent, failed, or the client gone (a pinned
    version's copy, api/storage.py). A generator's own `finally` ran only when the garbage collector got to it,
    Starlette leaving the iterator of an abandoned download unclosed."""

    def __init__(self, release: Callable[[], None], *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()
