"""The front of a prefix-routed app: reads each HTTP request's body, keys its prompt's prefix,
and passes it to the engine replicas through a handle whose router is PrefixAffinityRouter
(pipeline/serve/router.py); the replica runs the request through its own API (`run_asgi`) and
streams the ASGI messages back, which the front sends on unchanged (headers, status, SSE).

Why a front at all: Serve's proxy routes an HTTP request before its body is read, so a router
there cannot see the prompt. The replica's API still does all checking (keys, limits, the
guard's 413/408 on what the front passes on); the front only bounds what it reads.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from pipeline.serve.replicas import Receive, Scope, Send
from pipeline.serve.router import RoutedRequest, prefix_hashes, routing_text

ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
# The ASGI scope keys a replica's API needs (what Serve's proxy gives, minus local objects).
SCOPE_KEYS = (
    "type",
    "asgi",
    "http_version",
    "method",
    "scheme",
    "path",
    "raw_path",
    "root_path",
    "query_string",
    "headers",
    "client",
    "server",
)


async def read_body(receive: Receive, max_bytes: int, timeout_s: float) -> tuple[bytes, bool]:
    """The request body, and whether it is whole: reading stops after `max_bytes` + 1 bytes
    (the replica then answers 413) or after `timeout_s` (the replica's guard answers 408 when
    its own body timeout passes). A client that disconnects gives what it sent, not whole."""
    chunks: list[bytes] = []
    size = 0

    async def read() -> bool:
        nonlocal size
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return False
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            if not message.get("more_body", False):
                return True
            if size > max_bytes:
                return False

    try:
        complete = await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        complete = False
    return b"".join(chunks), complete


async def run_asgi(app: ASGIApp, request: RoutedRequest) -> AsyncIterator[Scope]:
    """Run `request` through `app` and yield the ASGI messages it sends. The app receives the
    body, then (when the caller stops listening, or the body was not whole) a disconnect;
    closing the iterator cancels the app's work on it."""
    messages: asyncio.Queue[Scope | None] = asyncio.Queue()
    closed = asyncio.Event()
    given = False

    async def receive() -> Scope:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": request.body, "more_body": not request.complete}
        await closed.wait()
        return {"type": "http.disconnect"}

    async def send(message: Scope) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(dict(request.scope), receive, send)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    try:
        while (message := await messages.get()) is not None:
            yield message
        await task  # its error, if any
    finally:
        closed.set()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class _Forwarded(Response):
    """A response that sends the engine replica's ASGI messages on as they come."""

    def __init__(self, messages: AsyncIterator[Scope]) -> None:  # no body of its own
        self._messages = messages

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async for message in self._messages:
            await send(message)


@serve.deployment(name="raypack-front", health_check_timeout_s=60)
class PrefixFront:
    """Reads each request, keys its prefix, and streams the engine replica's answer back. Not
    an ingress (an app has one, the engine's API): Serve hands it the Starlette request."""

    def __init__(self, engine: Any, max_body_bytes: int, body_timeout_s: float) -> None:
        # `engine`: the engine deployment's handle (Serve passes the bound app as one)
        self._engine = engine.options(method_name="routed", stream=True)
        self._max_body_bytes = max_body_bytes
        self._body_timeout_s = body_timeout_s

    async def __call__(self, request: Request) -> Response:
        body, complete = await read_body(
            request.receive, self._max_body_bytes, self._body_timeout_s
        )
        prefix = prefix_hashes(routing_text(body)) if complete else ()
        scope = request.scope
        routed = RoutedRequest(
            scope={key: scope[key] for key in SCOPE_KEYS if key in scope},
            body=body,
            complete=complete,
            prefix=prefix,
        )
        return _Forwarded(self._engine.remote(routed))
