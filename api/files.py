"""Chunk downloads whose Range errors answer like every other error, not as Starlette's plain text."""

from __future__ import annotations

from starlette.responses import FileResponse, MalformedRangeHeader, RangeNotSatisfiable

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
