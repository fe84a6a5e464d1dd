"""Echo2 Python SDK: `Client` / `AsyncClient` for the Echo2 REST API, its errors, and the wire protocol.

    import echo2
    with echo2.Client() as client:          # ECHO2_BASE_URL, ECHO2_API_KEY
        print(client.jobs.list().items)

Names are imported on first use, so `import echo2` (and the `echo2` CLI's `--help`) stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "protocol",
    "Client",
    "AsyncClient",
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
    "GoneError",
    "PayloadTooLargeError",
    "RateLimitError",
    "ServerError",
    "FieldReason",
]
_CLIENT = frozenset({"Client", "AsyncClient"})
_ERRORS = frozenset(__all__) - _CLIENT - {"__version__", "protocol"}

if TYPE_CHECKING:
    from . import protocol
    from .client import AsyncClient, Client
    from .errors import (
        APIStatusError,
        APITimeoutError,
        AuthenticationError,
        BadRequestError,
        CheckpointError,
        ConfigurationError,
        ConflictError,
        ConnectionError,
        Echo2Error,
        FieldReason,
        GoneError,
        NotFoundError,
        PayloadTooLargeError,
        PermissionDeniedError,
        RateLimitError,
        ServerError,
        UnexpectedResponseError,
        WaitTimeoutError,
    )


def __getattr__(name: str) -> Any:
    if name in _CLIENT:
        module = importlib.import_module(".client", __name__)
    elif name in _ERRORS:
        module = importlib.import_module(".errors", __name__)
    elif name == "protocol":
        return importlib.import_module(".protocol", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
