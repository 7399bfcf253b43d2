"""Headers Ray Serve's HTTP proxy cannot take, made harmless before the proxy reads them.

The proxy reads `X-Request-ID` (its tracing id, sent back as `X-Request-ID`) with
`bytes.decode()`: a value that is not UTF-8 (what `requests` and browsers send for a
non-ASCII `str`, Latin-1) raises in the proxy itself, and the client gets a text/plain 500
before any replica (or the app's own error handling) sees the request (Ray 2.60,
`serve/_private/proxy.py`). The app cannot answer it; only an ASGI middleware of the proxy
can, and Serve installs those from `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, a function
returning Starlette middlewares, read in the proxy's process when it starts.

`RequestIdFilter` drops an `X-Request-ID` that is not printable ASCII, so Serve generates
its own id and sends that back: the request is served as if the client had sent none (the
header is for tracing; a 400 for it would fail a valid request). `raypack serve` sets the
variable when it starts Ray itself (`use_in_proxy`); on a cluster started otherwise, set
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=pipeline.serve.proxy_headers:proxy_middlewares`
in the environment of `ray start` (docs/serve.md).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

PROXY_CALLBACK_VARIABLE = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "pipeline.serve.proxy_headers:proxy_middlewares"
REQUEST_ID_HEADER = b"x-request-id"


def printable_ascii(value: bytes) -> bool:
    """Whether a header value is visible ASCII and spaces (what a request id is made of)."""
    return all(0x20 <= byte <= 0x7E for byte in value)


class RequestIdFilter:
    """ASGI middleware: an HTTP request's `X-Request-ID` that is not printable ASCII is
    removed (see the module docstring); everything else passes untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = scope.get("headers") or []
        if scope.get("type") == "http" and any(
            key.lower() == REQUEST_ID_HEADER and not printable_ascii(value)
            for key, value in headers
        ):
            kept = [
                (key, value)
                for key, value in headers
                if key.lower() != REQUEST_ID_HEADER or printable_ascii(value)
            ]
            scope = {**scope, "headers": kept}
        await self.app(scope, receive, send)


def proxy_middlewares() -> list[Any]:
    """What Serve's proxy calls (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`): its extra
    middlewares, applied outside its own request-id middleware."""
    from starlette.middleware import Middleware

    return [Middleware(RequestIdFilter)]


def use_in_proxy(environ: MutableMapping[str, str]) -> bool:
    """Name `proxy_middlewares` in `environ` for the Serve proxy a local Ray starts with that
    environment, unless the operator named a callback of their own; True when it did."""
    if environ.get(PROXY_CALLBACK_VARIABLE):
        return False
    environ[PROXY_CALLBACK_VARIABLE] = PROXY_CALLBACK
    return True
