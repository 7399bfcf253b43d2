"""The front of a prefix-routed app: reads each HTTP request's body, keys its prompt's prefix,
and passes it to the engine replicas through a handle whose router is PrefixAffinityRouter
(pipeline/serve/router.py); the replica runs the request through its own API (`run_asgi`) and
streams the ASGI messages back, which the front sends on unchanged (headers, status, SSE).

Why a front at all: Serve's proxy routes an HTTP request before its body is read, so a router
there cannot see the prompt. The front reads bodies under the replicas' own guard
(pipeline/serve/guard.py, ServeConfig's limits: 413, 408, slow bodies capped per client and in
all with a 429, generic 500s), keyed on the client address Serve's proxy puts in the ASGI
scope, so slow senders are bounded where they are held; only whole bodies go on. The replica's
API still does all checking (keys, request limits, its own guard on what the front passes on).
/health goes on to a replica like any request (its answer is that replica's engine state); it
never enters an engine's staging queue and is never capped per client. GET /metrics is answered
by the front itself: every engine replica's snapshot (Serve's broadcast on the engine handle,
one call per replica) merged and rendered as Prometheus text (pipeline/serve/snapshots.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

from ray import serve
from ray.serve.exceptions import BackPressureError
from starlette.requests import Request
from starlette.responses import Response

from pipeline.serve.errors import overloaded
from pipeline.serve.guard import GuardLimits, GuardMiddleware, app_path, send_json
from pipeline.serve.metrics import app_snapshots
from pipeline.serve.replicas import DRAIN_CHECK_S, Receive, Scope, Send
from pipeline.serve.router import RoutedRequest, prefix_hashes, routing_text
from pipeline.serve.snapshots import ReplicaSnapshot, render

logger = logging.getLogger(__name__)

ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Forward = Callable[[RoutedRequest], AsyncIterator[Scope]]
Snapshots = Callable[[], Awaitable[list[ReplicaSnapshot]]]
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


def front_app(forward: Forward, limits: GuardLimits, snapshots: Snapshots | None = None) -> ASGIApp:
    """The front's ASGI app: the guard reads each body under `limits`, then the request, keyed
    by its prefix, goes to `forward` (the engine replicas' handle) and the ASGI messages it
    yields are sent on as they come. With `snapshots` (every replica's metrics), GET /metrics
    is answered here."""

    async def pass_on(scope: Scope, receive: Receive, send: Send) -> None:
        # the guard has read the body (a request without one: the proxy's empty message)
        body, complete = await read_body(receive, limits.max_body_bytes, limits.body_timeout_s)
        prefix = prefix_hashes(routing_text(body)) if complete else ()
        routed = RoutedRequest(
            scope={key: scope[key] for key in SCOPE_KEYS if key in scope},
            body=body,
            complete=complete,
            prefix=prefix,
        )
        started = False
        try:
            async for message in forward(routed):
                started = True
                await send(message)
        except BackPressureError as exc:  # every replica full and the handle's queue too
            if started:
                raise
            error = overloaded(str(exc), exc.retry_after_s)
            await send_json(send, error.status, error.body(), error.headers)

    guarded = cast(ASGIApp, GuardMiddleware(pass_on, limits))
    if snapshots is None:
        return guarded

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and app_path(scope) == "/metrics":
            await send_metrics(snapshots, scope, send)
        else:
            await guarded(scope, receive, send)

    return app


async def send_metrics(snapshots: Snapshots, scope: Scope, send: Send) -> None:
    """Answer GET /metrics: the replicas' snapshots rendered as the client's `accept` asks
    (Prometheus text by default); 503 when they cannot be had."""
    accept = dict(scope.get("headers") or ()).get(b"accept", b"").decode("latin-1")
    try:
        body, content_type = render(await snapshots(), accept)
    except Exception as exc:  # noqa: BLE001 (a scrape fails, the front goes on)
        logger.warning("GET /metrics failed: %r", exc)
        message = "the replicas' metrics could not be collected"
        await send_json(send, 503, {"error": {"message": message, "type": "server_error"}})
        return
    headers = [(b"content-type", content_type.encode()), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _Served(Response):
    """A response that runs the front's ASGI app on the request Serve gave it."""

    def __init__(self, app: ASGIApp) -> None:  # no body of its own
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._app(cast(dict[str, Any], scope), receive, send)  # the scope itself


@serve.deployment(
    name="raypack-front", health_check_timeout_s=60, graceful_shutdown_wait_loop_s=DRAIN_CHECK_S
)
class PrefixFront:
    """Reads each request, keys its prefix, and streams the engine replica's answer back. Not
    an ingress (an app has one, the engine's API): Serve hands it the Starlette request, and
    runs the response it returns on that request's ASGI scope, receive and send."""

    def __init__(self, engine: Any, limits: GuardLimits) -> None:
        # `engine`: the engine deployment's handle (Serve passes the bound app as one)
        handle = engine.options(method_name="routed", stream=True)
        self._app = front_app(handle.remote, limits, functools.partial(app_snapshots, handle))

    async def __call__(self, request: Request) -> Response:
        return _Served(self._app)
