"""Prefix-affinity routing (pipeline/serve/router.py, pipeline/serve/front.py).

Live: ONE app of two replicas of the tiny model (routing on, the default; conftest's
`two_replicas`, shared with the replicas and metrics tests) on the session's Serve: 4 long
documents x 3 questions, shuffled, one at a time; every request on a document is answered by
the same replica (`x-raypack-replica`) and each repeated one finds >= 90% of its document's
tokens cached. Without Ray: the routing decision, the prompt text it
keys, the front's body reading and its ASGI pass-through, and which apps route (routing off:
Serve's default router, no front). Live, the front's guard: slow bodies beyond a client's cap
are 429s and those within it 408s, answered by the front (no replica header), while /health and
a normal request answer. Timeouts are hang guards only."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from transformers import AutoTokenizer

from pipeline.serve import build_app
from pipeline.serve.config import ServeConfig
from pipeline.serve.front import read_body, run_asgi
from pipeline.serve.replicas import REPLICA_HEADER
from pipeline.serve.router import (
    CHUNK_CHARS,
    PrefixTable,
    RoutedRequest,
    choose_by_prefix,
    prefix_hashes,
    routing_text,
)
from tests.serve.conftest import MODEL

TOPICS = ["rivers", "engines", "gardens", "comets"]
QUESTIONS = ["What is it about?", "Name one detail.", "Summarize it briefly."]


def document(topic: str, seed: int) -> str:
    """A long document (~1,300 characters, ~280 tokens; with a question, within the tiny
    model's 512)."""
    rng = random.Random(seed)
    words = ["the", "of", "a", "small", "old", "river", "stone", "light", "north", "field"]
    body = " ".join(rng.choice(words) for _ in range(260))
    return f"Document about {topic} (#{seed}). {body}.\n\nQuestion: "


# --- the routing decision, without Ray --------------------------------------------------------


def test_prefix_hashes_share_leading_chunks_only() -> None:
    text = "x" * (3 * CHUNK_CHARS) + "tail"
    other = "x" * (2 * CHUNK_CHARS) + "y" * CHUNK_CHARS
    assert len(prefix_hashes(text)) == 3  # whole chunks only
    assert prefix_hashes(text)[:2] == prefix_hashes(other)[:2]
    assert prefix_hashes(text)[2] != prefix_hashes(other)[2]
    assert prefix_hashes("short") == ()


def test_routing_text_of_completions_and_chats() -> None:
    assert routing_text(json.dumps({"prompt": "doc q"}).encode()) == "doc q"
    assert routing_text(json.dumps({"prompt": ["first", "second"]}).encode()) == "first"
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}
    assert routing_text(json.dumps(chat).encode()) == "system\nS\nuser\nU\n"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "A"}]}]}
    assert routing_text(json.dumps(parts).encode()) == "user\nA\n"
    for body in (b"not json", b"[1]", b'{"prompt": [1, 2]}', b"\xff"):
        assert routing_text(body) == ""


def test_longest_prefix_wins_and_short_matches_fall_back() -> None:
    table = PrefixTable()
    doc_a, doc_b = prefix_hashes("a" * 4 * CHUNK_CHARS), prefix_hashes("b" * 4 * CHUNK_CHARS)
    table.record(doc_a, "r1")
    table.record(doc_b[:1], "r2")
    loads = {"r1": 0, "r2": 0}
    assert choose_by_prefix(table, doc_a, loads, min_match_chunks=2, saturated_at=8) == "r1"
    # only one chunk of b is known: too short, Serve's default decides
    assert choose_by_prefix(table, doc_b, loads, min_match_chunks=2, saturated_at=8) is None
    assert choose_by_prefix(table, doc_b, loads, min_match_chunks=1, saturated_at=8) == "r2"
    # a replica that is not a candidate (gone, or not chosen) is never picked
    assert choose_by_prefix(table, doc_a, {"r2": 0}, min_match_chunks=2, saturated_at=8) is None
    # the same prefix recorded later elsewhere: the latest holder
    table.record(doc_a[:3], "r2")
    assert table.longest_match(doc_a, {"r1", "r2"}) == ("r1", 4)
    assert table.longest_match(doc_a[:3], {"r1", "r2"}) == ("r2", 3)
    table.forget("r1")
    assert table.longest_match(doc_a, {"r1", "r2"}) == ("r2", 3)


def test_saturated_holder_falls_back_unless_all_are_as_busy() -> None:
    table = PrefixTable()
    doc = prefix_hashes("d" * 4 * CHUNK_CHARS)
    table.record(doc, "r1")
    choose = dict(min_match_chunks=2, saturated_at=8)
    assert choose_by_prefix(table, doc, {"r1": 7, "r2": 0}, **choose) == "r1"  # type: ignore[arg-type]
    assert choose_by_prefix(table, doc, {"r1": 8, "r2": 0}, **choose) is None  # type: ignore[arg-type]
    assert choose_by_prefix(table, doc, {"r1": 8, "r2": None}, **choose) is None  # type: ignore[arg-type]
    assert choose_by_prefix(table, doc, {"r1": 9, "r2": 9}, **choose) == "r1"  # type: ignore[arg-type]
    assert choose_by_prefix(table, doc, {"r1": None, "r2": 0}, **choose) == "r1"  # type: ignore[arg-type]


def test_table_forgets_oldest_beyond_capacity() -> None:
    table = PrefixTable(capacity=4)
    first, second = prefix_hashes("p" * 3 * CHUNK_CHARS), prefix_hashes("q" * 3 * CHUNK_CHARS)
    table.record(first, "r1")
    table.record(second, "r2")
    assert len(table) == 4
    assert table.longest_match(first[:2], {"r1"}) == ("", 0)  # its oldest chunks went
    assert table.longest_match(first, {"r1"}) == ("r1", 3)  # a chained hash names its prefix
    assert table.longest_match(second, {"r2"}) == ("r2", 3)


# --- the front's reading and pass-through, without Ray ----------------------------------------


def feeder(*messages: dict[str, Any]) -> Any:
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        if queue:
            return queue.pop(0)
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    return receive


def test_read_body_whole_too_large_and_slow() -> None:
    parts = (
        {"type": "http.request", "body": b"ab", "more_body": True},
        {"type": "http.request", "body": b"cd", "more_body": False},
    )
    assert asyncio.run(read_body(feeder(*parts), 100, 5.0)) == (b"abcd", True)
    big = {"type": "http.request", "body": b"x" * 11, "more_body": True}
    assert asyncio.run(read_body(feeder(big), 10, 5.0)) == (b"x" * 11, False)
    slow = {"type": "http.request", "body": b"x", "more_body": True}
    assert asyncio.run(read_body(feeder(slow), 10, 0.05)) == (b"x", False)
    gone = {"type": "http.disconnect"}
    assert asyncio.run(read_body(feeder(gone), 10, 5.0)) == (b"", False)


def test_run_asgi_gives_the_body_and_streams_the_answer_back() -> None:
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"got": (await request.json())["prompt"], "path": request.url.path})

    app = Starlette(routes=[Route("/v1/completions", echo, methods=["POST"])])
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    request = RoutedRequest(scope=scope, body=b'{"prompt": "hi"}')

    async def collect() -> list[dict[str, Any]]:
        return [message async for message in run_asgi(app, request)]

    start, body = asyncio.run(collect())
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert json.loads(body["body"]) == {"got": "hi", "path": "/v1/completions"}


def test_routing_is_on_with_replicas_and_off_by_flag_or_with_one() -> None:
    routed = build_app({"model": "m", "num_replicas": "2"})
    assert routed._bound_deployment.name == "raypack-front"
    (engine, *_) = routed._bound_deployment.init_args
    router = engine._bound_deployment._deployment_config.request_router_config
    assert router.request_router_class.endswith("router.PrefixAffinityRouter")
    autoscaled = build_app({"model": "m", "max_replicas": "3"})
    assert autoscaled._bound_deployment.name == "raypack-front"
    for args in ({"num_replicas": "2", "no_prefix_routing": "true"}, {"num_replicas": "1"}, {}):
        plain = build_app({"model": "m", **args})  # Serve's default router, no front
        assert plain._bound_deployment.name == "raypack-openai"
        config = plain._bound_deployment._deployment_config.request_router_config
        assert "PrefixAffinityRouter" not in str(config.request_router_class)


# --- two live replicas ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_shared_documents_go_to_one_replica_and_hit_its_cache(
    two_replicas: str, tiny_model_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    docs = {topic: document(topic, seed) for seed, topic in enumerate(TOPICS)}
    doc_tokens = {t: len(tokenizer.encode(d, add_special_tokens=False)) for t, d in docs.items()}
    asks = [(topic, question) for topic in TOPICS for question in QUESTIONS]
    random.Random(7).shuffle(asks)

    replicas: dict[str, set[str]] = {topic: set() for topic in TOPICS}
    seen: set[str] = set()
    ratios: list[float] = []
    for topic, question in asks:
        body = {"model": MODEL, "prompt": docs[topic] + question, "max_tokens": 2, "temperature": 0}
        answer = requests.post(f"{two_replicas}/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        replicas[topic].add(answer.headers[REPLICA_HEADER])
        cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        if topic in seen:
            ratios.append(cached / doc_tokens[topic])
        seen.add(topic)

    assert all(len(r) == 1 for r in replicas.values()), replicas
    hits = sum(ratio >= 0.9 for ratio in ratios)
    print(
        f"routing hit rate: {hits}/{len(ratios)} repeated requests >= 90% cached; ratios {ratios}"
    )
    assert hits == len(ratios) == len(TOPICS) * (len(QUESTIONS) - 1), ratios


def aborted_by_replica(base: str, replicas: int = 2) -> dict[str, int]:
    """Each replica's `aborted` count from `/health` (asked until Serve's router has sent one
    to each; hang guard only)."""
    seen: dict[str, int] = {}
    for _ in range(400):
        answer = requests.get(f"{base}/health", timeout=30)
        seen[answer.headers[REPLICA_HEADER]] = answer.json()["aborted"]
        if len(seen) == replicas:
            return seen
    raise AssertionError(f"/health reached only {sorted(seen)}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_client_leaving_a_routed_stream_aborts_it_on_its_replica(two_replicas: str) -> None:
    before = aborted_by_replica(two_replicas)
    body = {
        "model": MODEL,
        "prompt": document("tides", 9) + "Go on.",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    with requests.post(f"{two_replicas}/v1/completions", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        replica = r.headers[REPLICA_HEADER]
        next(r.iter_lines())  # the stream is running; leave at once
    # the connection is closed: the front cancels its call, and with it the replica's work
    for _ in range(600):  # hang guard
        if aborted_by_replica(two_replicas)[replica] > before[replica]:
            return
        time.sleep(0.1)
    raise AssertionError("the replica never dropped the stream of the client that left")


def open_slow_body(base: str, path: str) -> socket.socket:
    """Headers promising 1000 bytes of body, then 10 of them, then nothing."""
    where = urlsplit(base)
    sock = socket.create_connection((where.hostname, where.port), timeout=60)
    sock.sendall(
        f"POST {where.path}{path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
        + b"Content-Length: 1000\r\n\r\n"
        + b'{"model": '
    )
    return sock


def answer_of(sock: socket.socket) -> tuple[int, bytes]:
    """The status and the whole response (headers and body) the server sends on `sock`."""
    received = b""
    while piece := sock.recv(4096):
        received += piece
    sock.close()
    return (int(received.split(b" ", 2)[1]) if received else 0), received


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_front_caps_slow_bodies_per_client_and_keeps_answering(two_replicas: str) -> None:
    per_client = ServeConfig().max_slow_bodies_per_client
    socks = [open_slow_body(two_replicas, "/v1/completions") for _ in range(per_client + 4)]
    with ThreadPoolExecutor(max_workers=len(socks)) as pool:
        try:
            answers = [pool.submit(answer_of, sock) for sock in socks]
            # four beyond the client's cap are refused once the others count as slow; while
            # those are held, /health and a normal request answer
            for count, _ in enumerate(as_completed(answers, timeout=120), start=1):
                if count == 4:
                    break
            assert requests.get(f"{two_replicas}/health", timeout=60).status_code == 200
            body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
            answer = requests.post(f"{two_replicas}/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            results = [future.result(timeout=120) for future in answers]
        finally:
            for sock in socks:
                sock.close()
    statuses = sorted(status for status, _ in results)
    assert statuses == [408] * per_client + [429] * 4, results
    for _, raw in results:  # the front answered: no replica saw these requests
        assert REPLICA_HEADER.encode() not in raw.lower(), raw
    # keyed on the client's own address (Serve's proxy puts it in the scope)
    refused = [raw for status, raw in results if status == 429]
    assert b"bodies are still arriving from 127.0.0.1" in refused[0], refused[0]
