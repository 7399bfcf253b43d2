"""GuardMiddleware on its own (no Ray): body size and time limits, slow-body caps per client,
the per-client cap, and generic 500s. A plain ASGI app echoes what it received. Also the
prefix-routing front's app (pipeline/serve/front.py) over the same guard, its replicas an echo
run through run_asgi as a replica runs a routed request."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from pipeline.serve.front import front_app, run_asgi
from pipeline.serve.guard import GuardLimits, GuardMiddleware
from pipeline.serve.router import RoutedRequest

LIMITS = GuardLimits(
    max_body_bytes=100,
    body_timeout_s=0.4,
    max_slow_bodies_per_client=2,
    max_slow_bodies=3,
    grace_s=0.05,
)


async def echo(scope: dict, receive: Any, send: Any) -> None:
    """Reads the body and answers it back (or raises, for /boom)."""
    message = await receive()
    assert message["type"] == "http.request" and not message.get("more_body")
    if scope["path"] == "/boom":
        raise RuntimeError("secret internal detail")
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": message["body"]})


async def call(
    guard: Any,
    pieces: list[bytes],
    *,
    client: str = "10.0.0.1",
    path: str = "/v1/completions",
    method: str = "POST",
    length: int | None = None,
    stall: bool = False,
    root: str = "",
) -> tuple[int, bytes]:
    """One request whose body comes in `pieces`; `stall`: then nothing more ever comes."""
    queue: asyncio.Queue[dict] = asyncio.Queue()
    for i, piece in enumerate(pieces):
        more = stall or i < len(pieces) - 1
        queue.put_nowait({"type": "http.request", "body": piece, "more_body": more})
    headers = [(b"x-request-id", b"rid-1")]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    # Serve's proxy: the route prefix in `root_path` and in `path` too
    scope = {"type": "http", "method": method, "path": root + path, "headers": headers}
    scope["root_path"] = root
    scope["client"] = (client, 1234)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await guard(scope, queue.get, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


def test_whole_bodies_pass_and_oversized_ones_are_413() -> None:
    guard = GuardMiddleware(echo, LIMITS)
    assert run(call(guard, [b"ab", b"cd"])) == (200, b"abcd")
    status, body = run(call(guard, [b"x"], length=101))  # declared: refused before reading
    assert status == 413 and json.loads(body)["error"]["code"] == "body_too_large"
    status, _ = run(call(guard, [b"x" * 60, b"x" * 60]))  # no length: cut off at the limit
    assert status == 413


def test_a_slow_body_is_408_and_slow_bodies_are_capped_per_client_and_in_all() -> None:
    rejected: list[int] = []
    guard = GuardMiddleware(echo, LIMITS, on_reject=rejected.append)

    async def main() -> list[tuple[int, bytes]]:
        slow = [call(guard, [b"{"], stall=True) for _ in range(3)]  # client 10.0.0.1
        other = [call(guard, [b"{"], stall=True, client="10.0.0.2") for _ in range(2)]
        normal = call(guard, [b"{}"])  # the same client as three slow ones
        return await asyncio.gather(*slow, *other, normal)

    results = run(main())
    statuses = [status for status, _ in results]
    assert statuses[-1] == 200 and results[-1][1] == b"{}"
    # client 1: two slow ones within its cap (408 at the timeout), one more 429 at once;
    # client 2: one within the overall cap of 3, the other 429
    assert sorted(statuses[:3]) == [408, 408, 429]
    assert sorted(statuses[3:5]) == [408, 429]
    codes = {json.loads(body)["error"]["code"] for status, body in results if status == 429}
    assert codes == {"too_many_requests", "too_many_slow_bodies"}
    assert sorted(rejected) == [408, 408, 408, 429, 429]
    assert not guard._slow  # every slot given back
    # afterwards the caps are free again
    assert run(call(guard, [b"a", b"b"])) == (200, b"ab")


def test_waiting_for_the_first_piece_is_not_a_slow_body() -> None:
    """A body that arrives whole but late (a loaded proxy's pull) is served even when the
    client's slow-body slots are full; no body byte at all is a 408 at the timeout."""
    guard = GuardMiddleware(echo, LIMITS)

    async def late_whole_body() -> tuple[int, bytes]:
        queue: asyncio.Queue[dict] = asyncio.Queue()
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
        scope["client"] = ("10.0.0.1", 1234)
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        async def deliver() -> None:
            # well past grace_s, but within body_timeout_s
            while len(guard._slow) == 0 or guard._slow["10.0.0.1"] < 2:
                await asyncio.sleep(0.01)
            await asyncio.sleep(LIMITS.grace_s * 3)
            queue.put_nowait({"type": "http.request", "body": b"{}", "more_body": False})

        delivering = asyncio.create_task(deliver())
        await guard(scope, queue.get, send)
        await delivering
        status = next(m["status"] for m in sent if m["type"] == "http.response.start")
        return status, b"".join(m.get("body", b"") for m in sent if "body" in m)

    async def main() -> list[tuple[int, bytes]]:
        slow = [call(guard, [b"{"], stall=True) for _ in range(2)]  # the client's two slots
        return await asyncio.gather(*slow, late_whole_body(), call(guard, [], stall=True))

    results = run(main())
    assert results[2] == (200, b"{}")
    assert [status for status, _ in results[:2]] == [408, 408]
    status, body = results[3]  # headers only, then nothing: waited for, then 408
    assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
    assert not guard._slow


def test_exceptions_are_generic_500s_naming_the_request_id() -> None:
    status, body = run(call(GuardMiddleware(echo, LIMITS), [b"{}"], path="/boom"))
    error = json.loads(body)["error"]
    assert status == 500 and error["type"] == "server_error"
    assert "rid-1" in error["message"] and "secret" not in body.decode()


def test_requests_per_client_are_capped_except_health() -> None:
    limits = GuardLimits(**{**LIMITS.__dict__, "max_requests_per_client": 1})
    release = asyncio.Event()

    async def held(scope: dict, receive: Any, send: Any) -> None:
        await receive()
        if not scope["path"].endswith("/health"):
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = GuardMiddleware(held, limits)

    async def main() -> list[int]:
        first = asyncio.create_task(call(guard, [b"{}"]))
        await asyncio.sleep(0.05)
        second = await call(guard, [b"{}"])
        health = await call(guard, [b""], path="/health", method="GET")
        prefixed = await call(guard, [b""], path="/health", method="GET", root="/auth")
        other = asyncio.create_task(call(guard, [b"{}"], client="10.0.0.9"))
        await asyncio.sleep(0.05)
        release.set()
        return [(await first)[0], second[0], health[0], prefixed[0], (await other)[0]]

    # /health is never capped, under a route prefix too (an app at /auth sees /auth/health)
    assert run(main()) == [200, 429, 200, 200, 200]


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_bodiless_methods_are_not_read(method: str) -> None:
    status, _ = run(call(GuardMiddleware(echo, LIMITS), [b"q"], method=method))
    assert status == 200


def test_the_front_guards_slow_bodies_and_passes_only_whole_ones_on() -> None:
    """At the front: slow bodies beyond the client's cap are 429s, those within it 408s at the
    body timeout, and never reach a replica; a normal request and /health from the same client
    are answered meanwhile, with the client's real address in the scope passed on."""
    routed: list[RoutedRequest] = []

    def forward(request: RoutedRequest) -> Any:
        routed.append(request)
        return run_asgi(echo, request)

    front = front_app(forward, LIMITS)
    assert isinstance(front, GuardMiddleware) and front.limits == LIMITS

    async def main() -> list[tuple[int, bytes]]:
        slow = [asyncio.create_task(call(front, [b"{"], stall=True)) for _ in range(3)]
        # the third is refused once the other two hold the client's slots; they are still held
        await asyncio.wait(slow, return_when=asyncio.FIRST_COMPLETED)
        normal = await call(front, [b'{"prompt": ', b'"hi"}'])
        health = await call(front, [b""], path="/health", method="GET")
        return [*(await asyncio.gather(*slow)), normal, health]

    results = run(main())
    statuses = [status for status, _ in results]
    assert sorted(statuses[:3]) == [408, 408, 429] and statuses[3:] == [200, 200]
    (refused,) = [json.loads(body)["error"] for status, body in results[:3] if status == 429]
    assert refused["code"] == "too_many_requests" and "10.0.0.1" in refused["message"]
    assert results[3][1] == b'{"prompt": "hi"}'
    # only the normal request and /health went on, whole, with the client's address
    assert [r.scope["path"] for r in routed] == ["/v1/completions", "/health"]
    assert all(r.complete and r.scope["client"] == ("10.0.0.1", 1234) for r in routed)
    assert not front._slow
