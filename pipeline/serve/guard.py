"""An ASGI middleware in front of the API: bounded request bodies, and no internals in a 500.

Ray Serve's proxy hands a request to the replica as soon as its headers arrive, and the
replica pulls the body from the proxy as the client sends it, so a client that sends headers
and then trickles its body holds one of the replica's `max_ongoing_requests` slots for as long
as it likes (Serve has no body-read timeout; its `request_timeout_s` is end-to-end and would
also cut long generations). Here every body is read before the app sees the request:

- a declared or actual size over `max_body_bytes` is a 413, without reading further;
- a body not complete within `body_timeout_s` of the request's arrival is a 408;
- a body that has begun to arrive (a first piece with more to come) and is not complete
  within `grace_s` (1 s) of the request's arrival is a *slow body*: a client may have
  `max_slow_bodies_per_client` of them and the replica `max_slow_bodies`; one more is a 429
  at once, so slow senders can hold only a bounded share of the slots and /health and normal
  requests (whose bodies come with their headers) are never queued behind them. Waiting for
  the *first* piece is not counted: that wait is mostly the proxy's (on a loaded replica the
  pull from the proxy takes seconds, and a normal request then arrives whole but late; counting
  it made every normal request from one address a 429 in benchmarks/hostile_load.py), so a
  client that sends no body byte at all is bounded by `body_timeout_s` and Serve's
  `max_ongoing_requests` only;
- optionally (`max_requests_per_client`) a client's requests in progress are capped (429).

Any exception that escapes the app becomes a generic 500 naming the request id (Serve's
`x-request-id`, also sent back as `X-Request-ID`); the exception goes to the replica's log
under that id. After a response started (a stream) nothing more can be said: it is logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.serve.errors import APIError, internal_error

if TYPE_CHECKING:
    from pipeline.serve.config import ServeConfig

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
_NO_BODY_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})
_EXEMPT_PATHS = frozenset({"/health", "/metrics"})  # never capped per client: always answer


def app_path(scope: Scope) -> str:
    """The request's path inside the app: Serve puts the route prefix in both `path` and
    `root_path` (the ASGI spec's reading since 2.x), so an app under `/auth` sees
    `/auth/health`; the prefix is taken off."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        return str(path[len(root) :]) or "/"
    return str(path)


@dataclass(frozen=True)
class GuardLimits:
    """The middleware's limits (from ServeConfig)."""

    max_body_bytes: int
    body_timeout_s: float
    max_slow_bodies_per_client: int
    max_slow_bodies: int
    max_requests_per_client: int | None = None
    # A body still incomplete this long after arrival is a slow one. Not shorter: the replica
    # pulls the body from Serve's proxy by a remote call, which a loaded box can delay.
    grace_s: float = 1.0


def guard_limits(config: ServeConfig) -> GuardLimits:
    """The guard's limits from a ServeConfig (the replicas' API and the prefix front use them)."""
    return GuardLimits(
        max_body_bytes=config.max_body_bytes,
        body_timeout_s=config.body_timeout_s,
        max_slow_bodies_per_client=config.max_slow_bodies_per_client,
        max_slow_bodies=config.max_slow_bodies,
        max_requests_per_client=config.max_requests_per_client,
    )


def request_id_of(scope: Scope) -> str:
    """Serve's request id (its proxy adds `x-request-id`), or a fresh one outside Serve."""
    for name, value in scope.get("headers") or ():
        if name == b"x-request-id":
            return str(value.decode("latin-1"))
    return uuid.uuid4().hex


async def send_json(
    send: Any, status: int, body: dict[str, object], extra: dict[str, str] | None = None
) -> None:
    """A whole JSON response (with `extra` headers); the connection is closed after it (the
    body may be unread)."""
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(payload)),
        (b"connection", b"close"),
    ]
    headers += [
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in (extra or {}).items()
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class GuardMiddleware:
    """Reads each body under the limits, then runs the app; see the module docstring."""

    def __init__(
        self, app: Any, limits: GuardLimits, on_reject: Callable[[int], None] | None = None
    ) -> None:
        self.app = app
        self.limits = limits
        self.on_reject = on_reject
        self._slow: Counter[str] = Counter()  # client -> slow bodies being read
        self._in_flight: Counter[str] = Counter()  # client -> requests in progress

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = (scope.get("client") or ("unknown", 0))[0]
        capped = self.limits.max_requests_per_client is not None and (
            app_path(scope) not in _EXEMPT_PATHS
        )
        if capped and self._in_flight[client] >= self.limits.max_requests_per_client:  # type: ignore[operator]
            await self._reject(send, _too_many(client, "requests in progress"))
            return
        if capped:
            self._in_flight[client] += 1
        try:
            await self._guarded(scope, receive, send, client)
        finally:
            if capped:
                self._release(self._in_flight, client)

    async def _guarded(self, scope: Scope, receive: Any, send: Any, client: str) -> None:
        if scope.get("method", "GET") not in _NO_BODY_METHODS:
            try:
                body = await self._read_body(scope, receive, client)
            except APIError as exc:
                await self._reject(send, exc)
                return
            if body is None:  # the client went away
                return
            receive = _replay(body, receive)
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception:  # noqa: BLE001 (one request's failure must not reach the client or the loop)
            request_id = request_id_of(scope)
            logger.exception("request %s %s failed", request_id, scope.get("path"))
            if not started:
                await send_json(send, 500, internal_error(request_id).body())

    async def _read_body(self, scope: Scope, receive: Any, client: str) -> bytes | None:
        """The whole body, or an APIError (408, 413, 429); None if the client disconnected."""
        limits = self.limits
        declared = _content_length(scope)
        if declared is not None and declared > limits.max_body_bytes:
            raise _too_large(declared, limits.max_body_bytes)
        start = time.monotonic()
        body = bytearray()
        started = slow = False  # started: a first piece arrived
        try:
            while True:
                # before the first piece and once counted slow: the whole body timeout
                budget = limits.grace_s if started and not slow else limits.body_timeout_s
                try:
                    async with asyncio.timeout(max(0.0, start + budget - time.monotonic())):
                        message = await receive()
                except TimeoutError:
                    if budget == limits.body_timeout_s:
                        raise _timed_out(limits.body_timeout_s) from None
                    slow = self._take_slow_slot(client)
                    continue
                started = True
                if message["type"] == "http.disconnect":
                    return None
                body.extend(message.get("body", b""))
                if len(body) > limits.max_body_bytes:
                    raise _too_large(len(body), limits.max_body_bytes)
                if not message.get("more_body", False):
                    return bytes(body)
        finally:
            if slow:
                self._release(self._slow, client)

    def _take_slow_slot(self, client: str) -> bool:
        """Count one more slow body for `client`, or raise a 429 when it has too many."""
        limits = self.limits
        if self._slow[client] >= limits.max_slow_bodies_per_client:
            raise _too_many(client, "requests whose bodies are still arriving")
        if sum(self._slow.values()) >= limits.max_slow_bodies:
            raise APIError(
                429,
                f"the server is reading {limits.max_slow_bodies} slow request bodies already; "
                "send the body with the request",
                type="rate_limit_error",
                code="too_many_slow_bodies",
            )
        self._slow[client] += 1
        return True

    @staticmethod
    def _release(counts: Counter[str], client: str) -> None:
        counts[client] -= 1
        if counts[client] <= 0:
            del counts[client]

    async def _reject(self, send: Any, error: APIError) -> None:
        if self.on_reject is not None:
            self.on_reject(error.status)
        await send_json(send, error.status, error.body(), error.headers)


def _replay(body: bytes, receive: Any) -> Any:
    """A receive that gives the whole body once, then the real receive (disconnects)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # type: ignore[no-any-return]

    return replayed


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers") or ():
        if name == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isdigit() else None
    return None


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        413, f"the request body has {size} bytes; the limit is {limit}", code="body_too_large"
    )


def _timed_out(timeout_s: float) -> APIError:
    return APIError(
        408,
        f"the request body did not arrive within {timeout_s:g} s",
        code="request_timeout",
    )


def _too_many(client: str, what: str) -> APIError:
    return APIError(
        429,
        f"too many {what} from {client}; retry when some have finished",
        type="rate_limit_error",
        code="too_many_requests",
    )
