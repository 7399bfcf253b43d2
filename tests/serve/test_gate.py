"""Admission at the door (pipeline/serve/gate.py) and Serve's back-pressure settings: a request
the replica cannot take is a 429 with Retry-After and OpenAI's JSON body before its body is
read, /health passes whatever the load, the staging queue's deadline counts from the arrival
at the replica, and the app asks Serve for a bounded queue answered 503 with Retry-After.
No Ray cluster, no torch: ASGI apps are called directly."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

from actors.config import EngineConfig, SamplingParams
from packing.admission import AdmissionConfig
from pipeline.serve.app import build_app
from pipeline.serve.config import ServeConfig
from pipeline.serve.front import front_app
from pipeline.serve.gate import ARRIVAL_KEY, AdmissionGate, arrival_of
from pipeline.serve.guard import GuardLimits
from pipeline.serve.replicas import Replicas
from pipeline.serve.staging import EngineLoop, QueueTimeoutError
from tests.serve.test_queue_wait import held_loop
from tests.serve.test_replicas import deployment_of
from tests.serve.test_staging import FakeEngine, collect, run, until


class Load:
    """A stand-in for the engine loop's numbers the gate reads."""

    def __init__(
        self,
        max_waiting: int = 1,
        max_running: int | None = 1,
        max_queue_wait_s: float | None = None,
        rate: float | None = None,
    ) -> None:
        self.max_waiting = max_waiting
        self.max_running = max_running
        self.max_queue_wait_s = max_queue_wait_s
        self.num_running = 0
        self.rate = rate

    def finish_rate(self) -> float | None:
        return self.rate


def scope(method: str, path: str) -> dict[str, Any]:
    return {
        "type": "http", "method": method, "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "headers": [], "client": ("10.0.0.1", 1),
    }  # fmt: skip


async def call(
    app: Any, method: str, path: str, reads: list[str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One request through an ASGI app; status, headers and body. Each read of its body is
    recorded in `reads` (its path)."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if reads is not None:
            reads.append(path)
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope(method, path), receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


class HeldApp:
    """Answers 200 (a POST once released); records the scopes it saw."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.scopes: list[dict[str, Any]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.scopes.append(scope)
        if scope["method"] == "POST":
            while (await receive()).get("more_body"):  # the whole body: now the gate counts it
                pass
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def test_beyond_staging_plus_engine_capacity_is_a_429_before_the_body_health_passes() -> None:
    async def main() -> None:
        inner = HeldApp()
        rejected: list[int] = []
        gate = AdmissionGate(inner, Load(max_waiting=1, max_running=1), 3, rejected.append)
        held = [asyncio.create_task(call(gate, "POST", "/v1/completions")) for _ in range(2)]
        await until(lambda: gate.in_progress == 2, "two requests inside")
        reads: list[str] = []
        status, headers, body = await call(gate, "POST", "/v1/chat/completions", reads)
        assert reads == []  # refused before its body was read
        assert status == 429 and headers["retry-after"] == "3", (status, headers)
        assert headers["content-type"] == "application/json"
        error = json.loads(body)["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert "2 requests are in progress" in error["message"]
        assert rejected == [429] and gate.num_refused == 1
        assert (await call(gate, "GET", "/health"))[0] == 200  # never gated
        assert (await call(gate, "GET", "/v1/models"))[0] == 200
        inner.release.set()
        assert [s for s, _, _ in await asyncio.gather(*held)] == [200, 200]
        assert gate.in_progress == 0
        assert (await call(gate, "POST", "/v1/completions"))[0] == 200  # room again

    run(main())


def test_a_request_that_could_not_start_within_the_budget_is_refused_at_once() -> None:
    load = Load(max_waiting=100, max_running=2, max_queue_wait_s=1.0, rate=4.0)
    gate = AdmissionGate(HeldApp(), load, 1)
    gate.in_progress = 2  # the engine's two slots: a newcomer waits for one finish (0.25 s)
    assert gate.refusal() is None
    gate.in_progress = 5  # four finishes ahead: 1 s, within the budget
    assert gate.refusal() is None
    gate.in_progress = 6  # five: 1.25 s
    reason = gate.refusal()
    assert reason is not None and "5 requests are ahead" in reason and "1 s" in reason
    load.rate = None  # nothing measured yet: the staging queue's deadline decides
    assert gate.refusal() is None
    load.rate, load.max_queue_wait_s = 4.0, None  # no budget: only the capacity bound
    assert gate.refusal() is None


def test_the_gate_stamps_the_arrival_on_a_copy_of_the_state() -> None:
    async def main() -> None:
        inner = HeldApp()
        inner.release.set()
        gate = AdmissionGate(inner, Load(), 1, clock=lambda: 123.5)
        await call(gate, "POST", "/v1/completions")
        assert arrival_of(inner.scopes[0]) == 123.5
        assert inner.scopes[0]["state"] == {ARRIVAL_KEY: 123.5}
        await call(gate, "GET", "/health")
        assert arrival_of(inner.scopes[1]) is None  # not a generation request

    run(main())


def test_the_queue_deadline_counts_from_the_arrival_at_the_replica() -> None:
    async def main() -> None:
        gate = threading.Event()
        engine, loop = held_loop(gate, wait_s=30.0)
        loop.start()
        params = SamplingParams(max_tokens=2)
        first = loop.submit([1], params)
        await until(lambda: engine.steps == 1, "the first request's step")
        now = asyncio.get_running_loop().time()  # the loop's clock is time.monotonic too
        late = loop.submit([2], params, arrival=now - 60)  # reached the replica 60 s ago
        on_time = loop.submit([3], params)
        gate.set()  # the loop sheds between steps: the late one, before anything is admitted
        with pytest.raises(QueueTimeoutError, match="since it reached the replica"):
            await collect(late)
        assert loop.num_shed == 1
        assert (await collect(first))[-1].finished and (await collect(on_time))[-1].finished
        assert loop.finish_rate() is None  # idle again: the next busy spell measures anew
        await loop.stop()

    run(main())


def test_the_engine_loop_measures_its_finish_rate() -> None:
    clock = [100.0]
    loop = EngineLoop(
        FakeEngine(), AdmissionConfig(policy="immediate"), max_waiting=4, clock=lambda: clock[0]
    )
    assert loop.finish_rate() is None
    loop._busy_since = 100.0
    loop._finished_at.extend([100.5, 101.0, 101.5, 102.0])
    clock[0] = 102.0
    assert loop.finish_rate() == 2.0  # four in two busy seconds
    clock[0] = 150.0  # all older than the window
    assert loop.finish_rate() is None


def test_serve_back_pressure_is_bounded_and_answers_503_with_retry_after() -> None:
    engine = EngineConfig(dtype="float32", model="tiny")
    config = ServeConfig(engine=engine, api_keys_env=None, max_waiting=32, retry_after_s=4)
    # By default as many as the replica takes at once, never the staging queue's 32: Serve
    # counts requests being routed to a replica with room too (a small bound turned those away).
    assert config.queued_limit == config.ongoing_limit > 32
    deployed = deployment_of(build_app(config))._deployment_config
    assert deployed.max_queued_requests == config.ongoing_limit
    assert deployed.backpressure_config.status_code == 503
    assert deployed.backpressure_config.retry_after_s == 4
    # two replicas behind the routing front: both callers may hold what both replicas take
    two = ServeConfig(engine=engine, api_keys_env=None, replicas=Replicas(num_replicas=2))
    front = build_app(two)._bound_deployment
    (engine_app, *_) = front.init_args
    assert front._deployment_config.max_queued_requests == 2 * two.ongoing_limit
    assert engine_app._bound_deployment._deployment_config.max_queued_requests == (
        2 * two.ongoing_limit
    )
    bounded = ServeConfig(
        engine=engine, api_keys_env=None, replicas=Replicas(num_replicas=2), max_queued_requests=8
    )
    assert build_app(bounded)._bound_deployment._deployment_config.max_queued_requests == 16
    unlimited = ServeConfig(engine=engine, api_keys_env=None, max_queued_requests=-1)
    assert deployment_of(build_app(unlimited))._deployment_config.max_queued_requests == -1
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="max_queued_requests"):
            ServeConfig(engine=engine, max_queued_requests=bad)  # type: ignore[arg-type]


def test_the_front_answers_serves_back_pressure_as_a_json_503() -> None:
    from ray.serve.exceptions import BackPressureError

    async def forward(_: Any) -> Any:
        raise BackPressureError(num_queued_requests=8, max_queued_requests=8, retry_after_s=2.5)
        yield  # an async generator, as the handle's stream

    async def main() -> None:
        limits = GuardLimits(1024, 5.0, 4, 8)
        app = front_app(forward, limits)
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await app(scope("POST", "/v1/completions"), receive, send)
        start = sent[0]
        headers = {k.decode(): v.decode() for k, v in start["headers"]}
        assert start["status"] == 503 and headers["retry-after"] == "3"  # rounded up
        error = json.loads(sent[1]["body"])["error"]
        assert error["code"] == "overloaded" and "max_queued_requests=8" in error["message"]

    run(main())


def test_a_body_still_arriving_takes_no_place() -> None:
    async def main() -> None:
        inner = HeldApp()
        gate = AdmissionGate(inner, Load(max_waiting=1, max_running=None), 1)  # one place
        rest = asyncio.Event()
        pieces: list[bool] = []

        async def trickle() -> dict[str, Any]:  # a first piece, the rest when `rest` is set
            if not pieces:
                pieces.append(True)
                return {"type": "http.request", "body": b"{", "more_body": True}
            await rest.wait()
            return {"type": "http.request", "body": b"}", "more_body": False}

        async def quiet(_: dict[str, Any]) -> None:
            pass

        async def slow_one() -> None:
            await gate(scope("POST", "/v1/completions"), trickle, quiet)

        slow = asyncio.create_task(slow_one())
        await until(lambda: bool(pieces), "the slow body's first piece")
        assert gate.in_progress == 0  # held by its body: no place taken
        whole = asyncio.create_task(call(gate, "POST", "/v1/completions"))
        await until(lambda: gate.in_progress == 1, "the whole one inside")
        assert (await call(gate, "POST", "/v1/completions"))[0] == 429  # the place is taken
        rest.set()
        inner.release.set()
        assert (await whole)[0] == 200
        await slow

    run(main())
