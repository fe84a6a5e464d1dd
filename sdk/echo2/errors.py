"""The SDK's exceptions: one class per HTTP status family, all subclasses of `Echo2Error`.

Every API error carries what the server's problem+json body said (status, title, detail and the
per-field reasons), so callers can act on it without parsing text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

__all__ = [
    "Echo2Error",
    "ConfigurationError",
    "ConnectionError",
    "APITimeoutError",
    "UnexpectedResponseError",
    "WaitTimeoutError",
    "CheckpointError",
    "APIStatusError",
    "BadRequestError",
    "AuthenticationError",
    "PermissionDeniedError",
    "NotFoundError",
    "ConflictError",
    "PayloadTooLargeError",
    "RateLimitError",
    "ServerError",
    "FieldReason",
    "error_from_response",
]


@dataclass(frozen=True)
class FieldReason:
    """Which field of the request was wrong, and why (one entry of problem+json `errors`)."""

    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.field}: {self.reason}" if self.field else self.reason


class Echo2Error(Exception):
    """Base of every error the SDK raises. `status` is None when no HTTP answer was involved."""

    status: int | None = None

    def __init__(self, message: str, *, title: str | None = None, detail: str | None = None,
                 errors: list[FieldReason] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.title = title or type(self).__name__
        self.detail = detail if detail is not None else message
        self.errors: list[FieldReason] = list(errors or [])

    def __str__(self) -> str:
        return self.message


class ConfigurationError(Echo2Error):
    """The client is missing its base URL or API key, or was given an unusable value."""


class ConnectionError(Echo2Error):  # shadows the builtin on purpose: `echo2.ConnectionError`
    """The server could not be reached, or the connection broke (after all retries)."""

    def __init__(self, message: str, *, request: httpx.Request | None = None) -> None:
        super().__init__(message, title="Connection error")
        self.request = request


class APITimeoutError(ConnectionError):
    """The request timed out (after all retries)."""


class UnexpectedResponseError(Echo2Error):
    """A success status whose body is not what the protocol says (a proxy page, an older server...), or an
    answer larger than the call accepts (`echo2.transport.Call.max_bytes`)."""

    def __init__(self, message: str, *, response: httpx.Response | None = None) -> None:
        super().__init__(message, title="Unexpected response")
        self.response = response
        self.status = response.status_code if response is not None else None


class WaitTimeoutError(Echo2Error, TimeoutError):
    """`jobs.wait()` / `jobs.follow()` ran out of time before the job reached a terminal state."""


class CheckpointError(Echo2Error):
    """A downloaded checkpoint was unsafe (path traversal, links) or did not match its manifest."""


class APIStatusError(Echo2Error):
    """The server answered with a 4xx/5xx status; the fields come from its problem+json body."""

    def __init__(self, message: str, *, status: int | None, title: str, detail: str | None = None,
                 errors: list[FieldReason] | None = None, type: str = "about:blank",
                 response: httpx.Response | None = None, retry_after: float | None = None) -> None:
        super().__init__(message, title=title, detail=detail, errors=errors)
        self.status = status
        self.type = type
        self.response = response
        self.retry_after = retry_after

    @property
    def headers(self) -> httpx.Headers | None:
        return self.response.headers if self.response is not None else None


class BadRequestError(APIStatusError):
    """400 or 422: the request is invalid; `.errors` names each field and why.

    Also raised before sending, with `status` None, when a request body fails the protocol's own
    validation locally (the same field/reason form the server would have answered).
    """


class AuthenticationError(APIStatusError):
    """401: missing, unknown or revoked token."""


class PermissionDeniedError(APIStatusError):
    """403: the token is valid but not allowed to do this (wrong kind of token, not an admin...)."""


class NotFoundError(APIStatusError):
    """404: no such resource, or it belongs to someone else."""


class ConflictError(APIStatusError):
    """409: the resource's state forbids this (e.g. cancelling a finished job)."""


class GoneError(APIStatusError):
    """410: it existed but is gone for good (e.g. the weights of a version the server deleted)."""


class PayloadTooLargeError(APIStatusError):
    """413: the request body is over the server's limit."""


class RateLimitError(APIStatusError):
    """429: too many requests; `retry_after` says how long to wait when the server said so."""


class ServerError(APIStatusError):
    """5xx: the server failed; retried automatically for 503."""


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    410: GoneError,
    413: PayloadTooLargeError,
    422: BadRequestError,
    429: RateLimitError,
}


def error_class(status: int) -> type[APIStatusError]:
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    return ServerError if status >= 500 else APIStatusError


def error_from_response(response: httpx.Response, retry_after: float | None = None) -> APIStatusError:
    """Build the exception for an error answer, from its problem+json body when it has one."""
    status = response.status_code
    title = response.reason_phrase or "Error"
    detail: str | None = None
    kind = "about:blank"
    errors: list[FieldReason] = []
    body = _json_body(response)
    if isinstance(body, dict) and "title" in body:
        title = str(body.get("title") or title)
        detail = body.get("detail") if isinstance(body.get("detail"), str) else None
        kind = str(body.get("type") or kind)
        for item in body.get("errors") or []:
            if isinstance(item, dict):
                errors.append(FieldReason(str(item.get("field") or ""), str(item.get("reason") or "")))
    elif isinstance(body, dict) and "detail" in body:  # FastAPI's default shape, from a non-Echo2 proxy/app
        detail = str(body["detail"])
    else:
        detail = _not_echo2(response)
    message = format_message(status, title, detail, errors)
    return error_class(status)(message, status=status, title=title, detail=detail, errors=errors, type=kind,
                               response=response, retry_after=retry_after)


def format_message(status: int | None, title: str, detail: str | None, errors: list[FieldReason]) -> str:
    """One line a person can act on: `HTTP 422 Unprocessable Content: staleness: ... (also: ...)`."""
    head = f"HTTP {status} {title}" if status is not None else title
    # A route's own error repeats its detail as its field's reason: said once, after the field's name.
    own = next((e for e in errors if e.field and e.reason == detail), None)
    if own is not None and detail is not None and not detail.startswith(f"{own.field}:"):
        detail = f"{_named(own.field, detail)}: {detail}"
    text = f"{head}: {detail}" if detail else head
    extra = [str(e) for e in errors if str(e) and e is not own and not _said(e, detail, errors)]
    if extra:
        text += f" (also {'; '.join(extra[:5])}{'; ...' if len(extra) > 5 else ''})"
    return " ".join(text.split())


def _named(field: str, detail: str) -> str:
    """The field's name to put before its detail, less a qualifier the detail itself starts with:
    `dataset_id (item 0)` before `item 0: ...` is `dataset_id`."""
    name, _, qualifier = field.partition(" (")
    qualifier = qualifier.removesuffix(")")
    return name if qualifier and detail.startswith(f"{qualifier}:") else field


def _said(error: FieldReason, detail: str | None, errors: list[FieldReason]) -> bool:
    """Whether the detail already says this error: whole, or by its reason when the detail names no other
    field first (a summary, `2 bad lines of 6: line 2: ...; line 5: ...`, of the errors `file: line 2: ...`)."""
    if detail is None:
        return False
    if str(error) in detail:
        return True
    first = next((e.field for e in errors if e.field and detail.startswith(f"{e.field}:")), error.field)
    return first == error.field and error.reason in detail


def _not_echo2(response: httpx.Response) -> str:
    """Why an error answer that is not problem+json is no Echo2 control plane's (its body, often a whole HTML
    page from a proxy or another server, stays in `response`)."""
    url = response.request.url
    kind = response.headers.get("content-type", "").split(";")[0].strip() or "no Content-Type"
    return (f"the server at {url.scheme}://{url.netloc.decode()} answered {response.request.method} {url.path} "
            f"with {kind}, not Echo2's problem+json: it does not look like an Echo2 control plane (check the base "
            "URL, ECHO2_BASE_URL or --base-url, and any proxy in front of the server)")


def _json_body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except Exception:  # not JSON, or not read
        return None
