"""The live app's protection: every error with its status and body, auth, 429, disconnects, load."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from urllib.parse import urlsplit

import aiohttp
import pytest
import requests

from tests.serve.conftest import API_KEY, MODEL, Live

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT_OK = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
LONG_PROMPT = "word " * 600  # over the tiny model's 512-token context


def error_of(response: requests.Response, status: int) -> dict:
    """Check the status and OpenAI's error shape; return the error object."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [
        ("/v1/completions", {**OK, "foo": 1}, "foo", "unknown_field"),
        ("/v1/completions", {k: v for k, v in OK.items() if k != "prompt"}, "prompt", "missing_field"),
        ("/v1/completions", {**OK, "max_tokens": 0}, "max_tokens", None),
        ("/v1/completions", {**OK, "max_tokens": "5"}, "max_tokens", None),
        ("/v1/completions", {**OK, "max_tokens": 401}, "max_tokens", None),
        ("/v1/completions", {**OK, "temperature": 2.5}, "temperature", None),
        ("/v1/completions", {**OK, "top_p": 0}, "top_p", None),
        ("/v1/completions", {**OK, "n": 129}, "n", None),
        ("/v1/chat/completions", {**CHAT_OK, "n": 0}, "n", None),
        ("/v1/completions", {**OK, "logprobs": 21}, "logprobs", None),
        ("/v1/completions", {**OK, "echo": True}, "echo", "unsupported_value"),
        ("/v1/completions", {**OK, "n": 3, "best_of": 2}, "best_of", None),
        ("/v1/completions", {**OK, "best_of": 2, "stream": True}, "best_of", "unsupported_value"),
        ("/v1/chat/completions", {**CHAT_OK, "logprobs": 1}, "logprobs", None),
        ("/v1/chat/completions", {**CHAT_OK, "top_logprobs": 2}, "top_logprobs", None),
        ("/v1/completions", {**OK, "prompt": ""}, "prompt", None),
        ("/v1/completions", {**OK, "prompt": [1, 10**9]}, "prompt", None),
        ("/v1/completions", {**OK, "prompt": ["a", "b"]}, "prompt", None),
        ("/v1/completions", {**OK, "stop": ["a", "b", "c", "d", "e"]}, "stop", None),
        ("/v1/completions", {**OK, "stream_options": {"include_usage": True}}, "stream_options", None),
        ("/v1/completions", {**OK, "prompt": LONG_PROMPT}, "prompt", "context_length_exceeded"),
        ("/v1/completions", {**OK, "prompt": "hi " * 200, "max_tokens": 400}, "max_tokens", "context_length_exceeded"),
        ("/v1/chat/completions", {**CHAT_OK, "messages": []}, "messages", None),
        ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "bot", "content": "x"}]}, "messages.0.role", None),
        ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": LONG_PROMPT}]}, "messages", "context_length_exceeded"),
    ],
)  # fmt: skip
def test_invalid_requests_are_400_naming_the_field(
    live: Live, path: str, body: dict, param: str, code: str | None
) -> None:
    error = error_of(requests.post(live.url(path), json=body, timeout=30), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["code"] == code
    assert param.split(".")[0] in error["message"]


def test_unsupported_options_at_their_neutral_values_are_accepted(live: Live) -> None:
    neutral = {**OK, "n": 1, "logprobs": None, "echo": False, "best_of": 1}
    answer = requests.post(live.url("/v1/completions"), json=neutral, timeout=60)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 1
    chat = {**CHAT_OK, "n": 1, "logprobs": False, "top_logprobs": None}
    answer = requests.post(live.url("/v1/chat/completions"), json=chat, timeout=60)
    assert answer.status_code == 200, answer.text

    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=live.url("/v1"), api_key="not-checked", max_retries=0, timeout=60)
    with pytest.raises(BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, best_of=2, stream=True)
    assert raised.value.param == "best_of" and raised.value.code == "unsupported_value"


def test_malformed_bodies_unknown_model_route_and_size(live: Live) -> None:
    url = live.url("/v1/completions")
    headers = {"content-type": "application/json"}
    error = error_of(requests.post(url, data=b'{"model": ', headers=headers, timeout=30), 400)
    assert error["code"] == "invalid_json"
    error = error_of(requests.post(url, data=b"[1, 2]", headers=headers, timeout=30), 400)
    assert error["code"] == "invalid_body"
    error = error_of(requests.post(url, json={**OK, "model": "gpt-4"}, timeout=30), 404)
    assert error["param"] == "model" and error["code"] == "model_not_found"
    error_of(requests.get(live.url("/v1/nothing"), timeout=30), 404)
    error = error_of(requests.post(url, json={**OK, "prompt": "x" * 20_000}, timeout=30), 413)
    assert error["code"] == "body_too_large"
    # still healthy after all of that
    assert requests.post(url, json=OK, timeout=30).status_code == 200


def test_api_keys(live: Live) -> None:
    url = live.url("/v1/completions", "auth")
    error = error_of(requests.post(url, json=OK, timeout=30), 401)
    assert error["type"] == "authentication_error" and error["code"] == "missing_api_key"
    wrong = {"Authorization": "Bearer sk-wrong"}
    error = error_of(requests.post(url, json=OK, headers=wrong, timeout=30), 401)
    assert error["code"] == "invalid_api_key"
    error_of(requests.get(live.url("/v1/models", "auth"), timeout=30), 401)
    good = {"Authorization": f"Bearer {API_KEY}"}
    assert requests.post(url, json=OK, headers=good, timeout=30).status_code == 200
    assert requests.get(live.url("/health", "auth"), timeout=30).status_code == 200

    from openai import AuthenticationError, OpenAI

    base = live.url("/v1", "auth")
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=base, api_key="sk-wrong", max_retries=0).models.list()
    client = OpenAI(base_url=base, api_key=API_KEY, max_retries=0, timeout=60)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices


def test_full_staging_queue_is_429_with_retry_after(live: Live) -> None:
    from dataclasses import asdict

    from ray import serve

    from packing.admission import AdmissionConfig

    url = live.url("/v1/completions", "held")
    statuses: list[int] = []

    def send() -> None:
        statuses.append(requests.post(url, json=OK, timeout=120).status_code)

    held = [threading.Thread(target=send) for _ in range(2)]
    for thread in held:
        thread.start()
    # The window (HOLD_S) outlasts the test: the two stay queued until released below, so the
    # third request meets a full queue however slow the machine; 60 s only guards a hang.
    deadline = time.monotonic() + 60
    while requests.get(live.url("/health", "held"), timeout=10).json()["waiting"] < 2:
        assert time.monotonic() < deadline, f"the held requests never reached the queue: {statuses}"
        time.sleep(0.02)
    rejected = requests.post(url, json=OK, timeout=30)
    error = error_of(rejected, 429)
    assert rejected.headers["Retry-After"] == "3"
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert statuses == []  # still held
    handle = serve.get_app_handle("held")
    try:
        handle.reconfigure.remote({"admission": asdict(AdmissionConfig("immediate"))}).result()
        for thread in held:
            thread.join(timeout=120)
    finally:
        handle.reconfigure.remote({"admission": asdict(live.configs["held"].admission)}).result()
    assert statuses == [200, 200]  # released, both were served


def test_serve_turns_away_no_request_the_replica_has_room_for(live: Live) -> None:
    """Serve counts a request against max_queued_requests while its proxy routes it (the probe
    and reservation round trips to the replica), not only while every replica is full: more
    requests in flight at once than the held app's staging queue holds (2) are all let through
    to the replica, which has room for them (the 2026-11-25 hang: a /health poll and the 429
    test's two held requests, routed at once on a loaded box, and Serve answered one 503)."""

    async def main() -> list[int]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

            async def one() -> int:
                async with session.get(live.url("/health", "held")) as response:
                    await response.read()
                    return response.status

            return await asyncio.gather(*(one() for _ in range(40)))

    assert asyncio.run(main()) == [200] * 40


def test_disconnecting_stream_aborts_its_request(live: Live) -> None:
    before = requests.get(live.url("/health"), timeout=10).json()
    body = {**OK, "max_tokens": 400, "stream": True, "prompt": "Tell me a long story"}
    payload = json.dumps(body).encode()
    host = urlsplit(live.base)
    sock = socket.create_connection((host.hostname, host.port), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    received = b""
    while received.count(b"data: ") < 3:  # the stream has started: tokens are flowing
        piece = sock.recv(4096)
        assert piece, "the server closed the stream early"
        received += piece
    sock.close()
    deadline = time.monotonic() + 60  # a hang guard only
    while True:
        health = requests.get(live.url("/health"), timeout=10).json()
        if health["aborted"] == before["aborted"] + 1 and health["running"] == 0:
            break
        assert time.monotonic() < deadline, f"the request was not aborted: {health}"
        time.sleep(0.05)


def test_200_concurrent_requests_all_answered(live: Live) -> None:
    """Every request is answered 200 in the end, by a client that retries as the openai SDK
    does: a 429 (OpenAI's rate-limit body) after its Retry-After, a 408 after a back-off. The
    gate sheds requests it predicts cannot start within the start budget, at the rate the
    engine has been finishing them, so a box loaded by other work sheds some (the suite saw
    one of 200, 2026-11-26). A 408 is the guard's body timeout (3 s here): the replica pulls
    each body from Serve's proxy with an actor call, and with both test workers busy one of
    200 first pieces once took longer (CI, 2026-11-28); the SDK retries a 408 the same way."""
    sheds: list[dict] = []
    timeouts: list[dict] = []

    async def main() -> list[int]:
        timeout = aiohttp.ClientTimeout(total=180)
        connector = aiohttp.TCPConnector(limit=200)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

            async def one(i: int) -> int:
                body = {**OK, "prompt": f"Request number {i} says", "max_tokens": 4}
                if i % 2:
                    body = {**body, "stream": True}
                for attempt in range(3):
                    async with session.post(live.url("/v1/completions"), json=body) as response:
                        text = await response.text()
                        if response.status == 429:
                            sheds.append(json.loads(text)["error"])
                            await asyncio.sleep(float(response.headers["Retry-After"]))
                            continue
                        if response.status == 408:  # the SDK's back-off: 0.5 s, doubling
                            timeouts.append(json.loads(text)["error"])
                            await asyncio.sleep(0.5 * 2**attempt)
                            continue
                        if response.status == 200 and i % 2:
                            assert text.rstrip().endswith("data: [DONE]")
                        return response.status
                return 429

            return await asyncio.gather(*(one(i) for i in range(200)))

    statuses = asyncio.run(main())
    assert statuses == [200] * 200
    assert len(sheds) < 50, sheds[:3]  # a shed now and then, not the rule
    assert all(e["code"] == "rate_limit_exceeded" for e in sheds), sheds[:3]
    assert len(timeouts) < 10, timeouts[:3]  # a late first piece now and then, not the rule
    assert all(e["code"] == "request_timeout" for e in timeouts), timeouts[:3]
    health = requests.get(live.url("/health"), timeout=10).json()
    assert health["running"] == 0 and health["waiting"] == 0
