"""What both clients' resources are made of: each method is written once, as the request it sends
(`@endpoint`); on a `Client` resource it sends it and returns the parsed answer, on an `AsyncClient`
resource it returns a coroutine of the same. Also the request helpers they share: local validation
with the server's field/reason errors, path segments, query parameters, parsing of answers.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Coroutine
from functools import cache
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from . import errors
from .protocol.common import reason
from .transport import Call

if TYPE_CHECKING:
    from .client import AsyncClient, Client

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
P = ParamSpec("P")


@cache
def _adapter(cast: Any) -> TypeAdapter[Any]:
    return TypeAdapter(cast)


def parse(call: Call, cast: Any, response: httpx.Response) -> Any:
    """The success body as `cast` (None: no body; str: the text)."""
    if cast is None:
        return None
    if cast is str:
        return response.text
    try:
        return _adapter(cast).validate_json(response.content)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        name = getattr(cast, "__name__", str(cast))
        raise errors.UnexpectedResponseError(
            f"{call.method} {call.url} answered {response.status_code} with a body that is not a {name} "
            f"({where}: {reason(first)}); is ECHO2_BASE_URL an Echo2 server of a compatible version?",
            response=response,
        ) from None


def validated(model: type[M], data: Any) -> M:
    """Validate a request body locally, raising the same field/reason error the server would."""
    if isinstance(data, model):
        return data
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        reasons = [errors.FieldReason(".".join(str(p) for p in e["loc"]), reason(e)) for e in exc.errors()]
        detail = str(reasons[0])
        title = f"Invalid {model.__name__} (not sent)"
        raise errors.BadRequestError(errors.format_message(None, title, detail, reasons), status=None,
                                     title=title, detail=detail, errors=reasons) from None


def json_body(model: type[BaseModel], data: Any) -> dict[str, Any]:
    return validated(model, data).model_dump(mode="json")


def seg(value: str | int, what: str) -> str:
    """A path segment from a caller-given ID, quoted so it can never change the route."""
    text = str(value)
    if not text:
        raise ValueError(f"{what} must be a non-empty string")
    return quote(text, safe="")


def query(**values: Any) -> dict[str, Any]:
    return {k: (v.value if hasattr(v, "value") else v) for k, v in values.items() if v is not None}


class Resource:
    def __init__(self, client: Any) -> None:
        self._client = client


class SyncResource(Resource):
    _client: Client


class AsyncResource(Resource):
    _client: AsyncClient


class Endpoint(Generic[P, T]):
    """A resource method written as the request it sends: on a `Client` resource it sends it and returns
    the parsed answer, on an `AsyncClient` resource it returns a coroutine of the same."""

    def __init__(self, cast: Any, build: Callable[Concatenate[Any, P], Call]) -> None:
        self.cast, self.build = cast, build
        signature = inspect.signature(build)
        self.signature = signature.replace(parameters=list(signature.parameters.values())[1:],
                                           return_annotation=cast)

    @overload
    def __get__(self, obj: None, owner: type) -> Endpoint[P, T]: ...
    @overload
    def __get__(self, obj: AsyncResource, owner: type) -> Callable[P, Coroutine[Any, Any, T]]: ...
    @overload
    def __get__(self, obj: SyncResource, owner: type) -> Callable[P, T]: ...

    def __get__(self, obj: Resource | None, owner: type) -> Any:
        if obj is None:
            return self
        method = self._async(obj) if isinstance(obj, AsyncResource) else self._sync(obj)
        functools.update_wrapper(method, self.build)
        del method.__wrapped__  # type: ignore[attr-defined]  # help() shows the signature below instead
        method.__signature__ = self.signature  # type: ignore[attr-defined]
        return method

    def _sync(self, obj: Resource) -> Callable[..., Any]:
        def method(*args: Any, **kwargs: Any) -> Any:
            return obj._client._call(self.build(obj, *args, **kwargs), self.cast)
        return method

    def _async(self, obj: Resource) -> Callable[..., Any]:
        async def method(*args: Any, **kwargs: Any) -> Any:
            return await obj._client._call(self.build(obj, *args, **kwargs), self.cast)
        return method


@overload
def endpoint(cast: None) -> Callable[[Callable[Concatenate[Any, P], Call]], Endpoint[P, None]]: ...
@overload
def endpoint(cast: type[T]) -> Callable[[Callable[Concatenate[Any, P], Call]], Endpoint[P, T]]: ...


def endpoint(cast: Any) -> Any:
    """Declare a resource method by the request it builds; the answer parses into `cast` (None: no body)."""
    return lambda build: Endpoint(cast, build)
