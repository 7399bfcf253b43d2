"""Slow and heavy clients against the live app (issue 18 cases 3 and 7): held bodies get 408
or 429 and never starve /health or a normal request; a 1 MB prompt is tokenized off the
event loop. Timeouts here are hang guards only."""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlsplit

import pytest
import requests

from tests.serve.conftest import API_KEY, MODEL, Live

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

OK = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
SLOW_CONNECTIONS = 60
PER_CLIENT_SLOW = 16  # ServeConfig's default max_slow_bodies_per_client


def open_slow_body(live: Live, path: str) -> socket.socket:
    """Headers promising 1000 bytes of body, then 10 of them, then nothing."""
    where = urlsplit(live.base)
    sock = socket.create_connection((where.hostname, where.port), timeout=60)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
        + b"Content-Length: 1000\r\n\r\n"
        + b'{"model": '
    )
    return sock


def status_of(sock: socket.socket) -> int:
    """The status of the one response the server sends on `sock`."""
    received = b""
    while b"\r\n" not in received:
        piece = sock.recv(4096)
        if not piece:
            break
        received += piece
    sock.close()
    return int(received.split(b" ", 2)[1]) if received else 0


def _answered(send):  # noqa: ANN001, ANN202 (a request function; its response)
    """`send()` again while Serve's own back-pressure answers 503 (its max_queued_requests
    counts a burst of arrivals until a replica accepts them, which on a loaded box can pass
    the bound for a moment; seen twice in the suite, 2026-11-26), after its Retry-After or
    0.2 s, for at most 3 s: a client told to retry is not starved."""
    deadline = time.monotonic() + 3
    answer = send()
    while answer.status_code == 503 and time.monotonic() < deadline:
        time.sleep(min(0.2, float(answer.headers.get("Retry-After", 0.2))))
        answer = send()
    return answer


def test_held_bodies_do_not_starve_health_or_normal_requests(live: Live) -> None:
    """The auth app takes 48 requests at once (Serve's max_ongoing_requests): without a body
    timeout and the slow-body caps, 60 held bodies would queue everything behind them."""
    assert live.configs["auth"].ongoing_limit < SLOW_CONNECTIONS
    socks = [open_slow_body(live, "/auth/v1/completions") for _ in range(SLOW_CONNECTIONS)]
    held_until = time.monotonic() + 5  # the bodies time out after 10 s (body_timeout_s)
    try:
        health = _answered(lambda: requests.get(live.url("/health", "auth"), timeout=60))
        assert health.status_code == 200
        key = {"Authorization": f"Bearer {API_KEY}"}
        answer = _answered(
            lambda: requests.post(
                live.url("/v1/completions", "auth"), json=OK, headers=key, timeout=60
            )
        )
        assert answer.status_code == 200, answer.text
        assert time.monotonic() < held_until  # answered while every body was still held
        statuses = [status_of(sock) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    # 408: waited for, then timed out; 429: over the slow-body caps; 503: Serve's own
    # back-pressure (max_queued_requests), which counts a request from its arrival until a
    # replica accepts it, so a burst of 60 at once can pass the bound on a loaded box (seen
    # once in the suite, 2026-11-26). Each is an answer; none holds the others up.
    assert set(statuses) <= {408, 429, 503}, statuses
    # within the per-client cap the bodies were waited for, then timed out
    assert statuses.count(408) >= PER_CLIENT_SLOW, statuses
    assert requests.get(live.url("/health", "auth"), timeout=60).json()["status"] == "ok"


def test_a_1mb_prompt_is_tokenized_off_the_event_loop(live: Live) -> None:
    """While a 1 MB prompt is parsed and tokenized (about a second or more), /health keeps
    answering on the same replica; then the prompt is a 400 (too long for the context)."""
    words = " ".join(f"word{i % 997} and" for i in range(90_000))[:1_000_000]
    body = {"model": MODEL, "prompt": words, "max_tokens": 1}
    result: dict[str, requests.Response] = {}

    def big() -> None:
        result["answer"] = requests.post(
            live.url("/v1/completions", "held"), json=body, timeout=120
        )

    thread = threading.Thread(target=big)
    thread.start()
    answered = 0
    while thread.is_alive():
        health = requests.get(live.url("/health", "held"), timeout=60)
        assert health.status_code == 200
        if thread.is_alive():
            answered += 1
        time.sleep(0.02)
    thread.join()
    error = result["answer"].json()["error"]
    assert result["answer"].status_code == 400 and error["code"] == "context_length_exceeded"
    assert answered >= 5, f"only {answered} /health answers while the prompt was in flight"
