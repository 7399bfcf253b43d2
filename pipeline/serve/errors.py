"""OpenAI-style errors: one exception type carrying the status, and the JSON body it becomes.

A 500 never shows an exception's text (it can carry internals): it names the request id, and
the cause goes to the replica's log under that id.
"""

from __future__ import annotations

import math

from pydantic import ValidationError

from pipeline.serve.protocol import UNSUPPORTED_PART, ErrorDetail, ErrorResponse

# Parts of a pydantic error location that name a union member, not a field.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "function-after"})


class APIError(Exception):
    """An error answered to the client: HTTP status plus OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 (OpenAI's field name)
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=type, param=param, code=code)
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        """The JSON body: {"error": {"message", "type", "param", "code"}}."""
        return ErrorResponse(error=self.detail).model_dump()


def internal_error(request_id: str) -> APIError:
    """A 500 that says nothing of the cause (the caller logs it) and names the request id."""
    return APIError(
        500,
        f"the server could not complete the request (id {request_id}); the cause is logged",
        type="server_error",
        code="internal_error",
    )


def busy(reason: str, retry_after_s: int) -> APIError:
    """429 with Retry-After: the replica cannot take the request now (its staging queue or
    engine is full, or the request could not start within the start budget)."""
    return APIError(
        429,
        f"the server is busy ({reason}); retry after {retry_after_s} s",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_s)},
    )


def overloaded(reason: str, retry_after_s: float | None = None) -> APIError:
    """503 with Retry-After: Serve's back-pressure turned the request away (every engine replica
    is full and as many requests as allowed wait for one)."""
    retry = retry_after_s if retry_after_s is not None else 1
    return APIError(
        503,
        f"the server is overloaded ({reason}); retry after {retry:g} s",
        type="server_error",
        code="overloaded",
        headers={"Retry-After": str(math.ceil(retry))},
    )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 invalid_request_error."""
    return APIError(400, message, param=param, code=code)


def from_validation_error(exc: ValidationError) -> APIError:
    """A 400 naming the first field at fault (or saying the JSON could not be parsed)."""
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return bad_request(
            f"the request body is not valid JSON: {first['msg']}", code="invalid_json"
        )
    param = _param_name(first["loc"])
    if first["type"] == "extra_forbidden":
        return bad_request(
            f"unknown field '{param}': this server does not support it", param, "unknown_field"
        )
    if first["type"] == UNSUPPORTED_PART:
        return bad_request(first["msg"], param, "unsupported_value")
    if first["type"] == "missing":
        return bad_request(f"'{param}' is a required field", param, "missing_field")
    if first["type"] == "model_type" and not param:
        return bad_request("the request body must be a JSON object", code="invalid_body")
    got = first.get("input")
    shown = repr(got) if not isinstance(got, dict | list) else type(got).__name__
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return bad_request(f"invalid value for '{param}': {first['msg']} (got {shown})", param)


def _param_name(loc: tuple[int | str, ...]) -> str:
    """Dotted field path without union-member tags: ('messages', 0, 'role') -> messages.0.role."""
    parts = [str(p) for p in loc if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p))]
    return ".".join(parts)
