"""An ASGI middleware around the API: no exception text in a 500, whatever a route raised.

Sits inside FastAPI (added with `add_middleware`), so it sees every exception the routes and
exception handlers let through. Before the response started it answers OpenAI's error body
with a generic message naming the request id (Serve's `x-request-id`, also sent back as the
`X-Request-ID` header); the exception and its traceback go to the replica's log under that id.
After the response started (a stream) nothing more can be said to the client: it is logged and
the response ends.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from pipeline.serve.errors import internal_error

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]


def request_id_of(scope: Scope) -> str:
    """Serve's request id (its proxy adds `x-request-id`), or a fresh one outside Serve."""
    for name, value in scope.get("headers") or ():
        if name == b"x-request-id":
            return str(value.decode("latin-1"))
    return uuid.uuid4().hex


async def send_json(send: Any, status: int, body: dict[str, object]) -> None:
    """A whole JSON response."""
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class GuardMiddleware:
    """Turns any exception that escapes the app into a generic 500 JSON body (logged in full)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
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
