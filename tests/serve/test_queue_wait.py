"""`max_queue_wait_s`: a request still waiting for the engine after that long is answered 429
with Retry-After (shed), the ones in the engine finish, newcomers are served. The loop with a
scripted engine (no Ray, no torch), and the FastAPI app over it (the 429's body and header)."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import pytest

from actors.config import EngineConfig, SamplingParams
from packing.admission import AdmissionConfig
from pipeline.serve.app import create_api
from pipeline.serve.cli import add_limit_arguments, serve_config_from_app_args
from pipeline.serve.config import DEFAULT_MAX_QUEUE_WAIT_S, ServeConfig
from pipeline.serve.errors import APIError
from pipeline.serve.service import OpenAIService
from pipeline.serve.staging import EngineLoop, QueueTimeoutError
from tests.serve.test_staging import FakeEngine, collect, run, until
from tests.tiny_tokenizers import tiny_tokenizer

WAIT_S = 0.2


def held_loop(gate: threading.Event, wait_s: float = WAIT_S) -> tuple[FakeEngine, EngineLoop]:
    """One request at a time in the engine, whose first step waits for `gate`; requests wait
    at most `wait_s` for it."""
    engine = FakeEngine(gate=gate)
    loop = EngineLoop(
        engine,
        AdmissionConfig(policy="immediate"),
        max_waiting=8,
        max_running=1,
        max_queue_wait_s=wait_s,
    )
    return engine, loop


def test_requests_waiting_too_long_are_shed_and_the_rest_served() -> None:
    async def main() -> None:
        gate = threading.Event()
        engine, loop = held_loop(gate)
        loop.start()
        params = SamplingParams(max_tokens=3)
        streams = [loop.submit([i], params) for i in range(3)]
        await until(lambda: engine.steps == 1, "the first step")  # request 0 in the engine
        assert (loop.num_running, loop.num_waiting) == (1, 2)
        await asyncio.sleep(WAIT_S * 1.5)  # the two waiting ones are now over the limit
        gate.set()
        results = await asyncio.gather(*(collect(s) for s in streams), return_exceptions=True)
        assert results[0][-1].finish_reason == "length"  # the one in the engine finished
        for shed in results[1:]:
            assert isinstance(shed, QueueTimeoutError), results
            assert "max_queue_wait_s 0.2" in str(shed)
        assert loop.num_shed == 2 and engine.admitted_groups == [[streams[0].request_id]]
        later = await collect(loop.submit([7], params))  # a newcomer in time is served
        assert later[-1].finished
        await loop.stop()

    run(main())


def test_no_limit_waits_as_long_as_it_takes() -> None:
    async def main() -> None:
        gate = threading.Event()
        engine = FakeEngine(gate=gate)
        loop = EngineLoop(engine, AdmissionConfig(policy="immediate"), max_waiting=8, max_running=1)
        loop.start()
        streams = [loop.submit([i], SamplingParams(max_tokens=2)) for i in range(3)]
        await until(lambda: engine.steps == 1, "the first step")
        await asyncio.sleep(WAIT_S * 1.5)
        gate.set()
        results = await asyncio.gather(*(collect(s) for s in streams))
        assert all(r[-1].finished for r in results) and loop.num_shed == 0
        await loop.stop()

    run(main())


async def post(api, path: str, body: dict) -> tuple[int, dict[str, str], dict]:  # noqa: ANN001
    """One request through the ASGI app; its status, headers and JSON body."""
    sent: list[dict] = []
    given = False

    async def receive() -> dict:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await asyncio.sleep(3600)  # the client stays: no disconnect
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "scheme": "http", "http_version": "1.1",
        "headers": [(b"content-type", b"application/json")], "client": ("10.0.0.1", 1),
        "server": ("test", 80),
    }  # fmt: skip
    await api(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], headers, json.loads(payload)


def test_a_shed_request_is_a_429_with_retry_after() -> None:
    tokenizer = tiny_tokenizer("bos")
    config = ServeConfig(
        engine=EngineConfig(dtype="float32", model="tiny"),
        served_model_name="tiny",
        max_queue_wait_s=WAIT_S,
        retry_after_s=2,
        api_keys_env=None,
    )
    assert ServeConfig(max_queue_wait_s=None).max_queue_wait_s is None
    with pytest.raises(ValueError, match="max_queue_wait_s must be > 0"):
        ServeConfig(max_queue_wait_s=0)

    async def main() -> None:
        gate = threading.Event()
        engine, loop = held_loop(gate)
        loop.start()
        service = OpenAIService(config, loop, tokenizer, 512, len(tokenizer))
        api = create_api(service, frozenset())
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 2}
        first = asyncio.create_task(post(api, "/v1/completions", body))
        await until(lambda: engine.steps == 1, "the first request's step")
        second = asyncio.create_task(post(api, "/v1/completions", body))
        await until(lambda: loop.num_waiting == 1, "the second request in the queue")
        await asyncio.sleep(WAIT_S * 1.5)
        gate.set()
        status, headers, answer = await second
        assert status == 429, answer
        assert headers["retry-after"] == "2"
        assert answer["error"]["code"] == "rate_limit_exceeded"
        assert "waited" in answer["error"]["message"], answer
        assert (await first)[0] == 200
        await loop.stop()

    run(main())


def test_the_default_deadline_sheds_with_the_documented_429() -> None:
    """By default (issue 31: none was set, and under 300 requests of max_tokens 2048 neighbours
    waited over 120 s) a request still out of the engine `DEFAULT_MAX_QUEUE_WAIT_S` after it
    reached the replica is answered 429 `rate_limit_exceeded` with Retry-After; 'none' on the
    command line lifts it. The request's arrival is stamped that long ago (as the gate stamps
    it) rather than waited for."""
    config = ServeConfig(
        engine=EngineConfig(dtype="float32", model="tiny"),
        served_model_name="tiny",
        api_keys_env=None,
    )
    assert config.max_queue_wait_s == DEFAULT_MAX_QUEUE_WAIT_S == 30.0
    parser = argparse.ArgumentParser()
    add_limit_arguments(parser)
    assert parser.parse_args([]).max_queue_wait == DEFAULT_MAX_QUEUE_WAIT_S
    assert parser.parse_args(["--max-queue-wait", "none"]).max_queue_wait is None
    assert parser.parse_args(["--max-queue-wait", "5"]).max_queue_wait == 5.0
    with pytest.raises(ValueError, match="--max-queue-wait: expected seconds .* got 'soon'"):
        serve_config_from_app_args({"max_queue_wait": "soon"})
    tokenizer = tiny_tokenizer("bos")

    async def main() -> None:
        gate = threading.Event()
        engine, loop = held_loop(gate, wait_s=config.max_queue_wait_s)
        loop.start()
        service = OpenAIService(config, loop, tokenizer, 512, len(tokenizer))
        body = json.dumps({"model": "tiny", "prompt": "hello there", "max_tokens": 2}).encode()
        first = service.prepare_completion(body)
        running = service.submit(first)
        await until(lambda: engine.steps == 1, "the first request's step")
        late = service.prepare_completion(body)
        stale = time.monotonic() - DEFAULT_MAX_QUEUE_WAIT_S - 1  # reached the replica 31 s ago
        answer = asyncio.create_task(service.respond(late, service.submit(late, stale)))
        gate.set()  # the loop sheds between two steps
        with pytest.raises(APIError) as info:
            await answer
        error = info.value
        assert error.status == 429 and error.headers == {"Retry-After": "1"}
        assert error.body()["error"]["code"] == "rate_limit_exceeded"
        assert "max_queue_wait_s 30" in error.body()["error"]["message"]
        assert (await service.respond(first, running)).choices[0].finish_reason == "length"
        await loop.stop()

    run(main())
