"""GET /metrics on live apps: Prometheus text of ALL the app's replicas.

Two replicas of the tiny model (tests/serve/conftest.py's two_replica_args), once behind the
prefix-routing front (conftest's shared `two_replicas`; the front asks every replica) and once
without it (a fresh app; the replica that gets /metrics asks every replica of its deployment):
after completions that both replicas served (`x-raypack-replica`), the TTFT histogram has
counted every finished request more than before them, and the generation-token counter has
grown by the sum of their usage.completion_tokens. One replica (conftest's
`main` app) answers from its own engine, and /metrics needs no API key (as /health, as vLLM's).
Timeouts are hang guards only."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from pipeline.serve import build_app
from pipeline.serve.replicas import REPLICA_HEADER
from tests.serve.conftest import MODEL, Live, ServeInstance, two_replica_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [f"Request number {i} says hello to" for i in range(6)]


def metrics_of(url: str) -> tuple[Mapping[str, str], dict[str, list[tuple[dict[str, str], float]]]]:
    """GET /metrics: its headers, and sample name -> [(labels, value)]."""
    answer = requests.get(url, timeout=60)
    assert answer.status_code == 200, answer.text
    parsed: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            parsed.setdefault(sample.name, []).append((sample.labels, sample.value))
    return answer.headers, parsed


def total(parsed: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(v for _, v in parsed.get(name, []))  # 0 before any request


@pytest.fixture(scope="module", params=["front", "no-front"])
def two_replica_app(
    request: pytest.FixtureRequest, serve_instance: ServeInstance, tiny_model_dir: Path
) -> Iterator[str]:
    """Two replicas with the prefix-routing front (conftest's shared `two_replicas`), or a
    fresh app of two without it; its base URL."""
    from ray import serve

    if request.param == "front":
        yield request.getfixturevalue("two_replicas")
        return
    name = "metrics-no-front"
    args = two_replica_args(tiny_model_dir)
    args["no_prefix_routing"] = "true"
    serve.run(build_app(args), name=name, route_prefix=f"/{name}")
    try:
        yield f"{serve_instance.base}/{name}"
    finally:
        serve.delete(name)


def test_metrics_of_two_replicas_cover_both(two_replica_app: str) -> None:
    def ask(i: int) -> tuple[str, int]:
        body = {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": 2 + i, "temperature": 0}
        answer = requests.post(f"{two_replica_app}/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.headers[REPLICA_HEADER], answer.json()["usage"]["completion_tokens"]

    _, before = metrics_of(f"{two_replica_app}/metrics")  # the shared app served others
    served: dict[str, int] = {}  # replica -> requests it finished
    completion_tokens = 0
    deadline = time.monotonic() + 180  # hang guard: Serve's router spreads concurrent requests
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        while len(served) < 2:
            assert time.monotonic() < deadline, f"replicas seen: {sorted(served)}"
            for replica, tokens in pool.map(ask, range(len(PROMPTS))):
                served[replica] = served.get(replica, 0) + 1
                completion_tokens += tokens
    finished = sum(served.values())

    headers, parsed = metrics_of(f"{two_replica_app}/metrics")
    assert headers["content-type"].startswith("text/plain; version=0.0.4"), headers
    # the front answers itself; without it, the replica that got the request asked the others
    assert (REPLICA_HEADER in headers) == two_replica_app.endswith("no-front"), headers

    def added(name: str) -> float:
        return total(parsed, name) - total(before, name)

    assert added("raypack:time_to_first_token_seconds_count") == finished
    assert added("raypack:e2e_request_latency_seconds_count") == finished
    assert added("raypack:request_success_total") == finished
    assert added("raypack:generation_tokens_total") == completion_tokens
    # every token after a request's first one had a gap
    assert added("raypack:inter_token_latency_seconds_count") == completion_tokens - finished
    assert added("raypack:prompt_tokens_total") > 0
    assert total(parsed, "raypack:num_replicas") == 2
    assert total(parsed, "raypack:num_requests_running") == 0
    per_replica = parsed["raypack:replica_kv_cache_usage_perc"]
    assert {labels["replica"] for labels, _ in per_replica} == set(served)
    for name in ("raypack:kv_cache_usage_perc", "raypack:prefix_cache_hit_rate"):
        assert 0.0 <= total(parsed, name) <= 1.0


def test_one_replica_answers_from_its_own_engine_without_a_key(live: Live) -> None:
    _, before = metrics_of(live.url("/metrics"))
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0}
    answer = requests.post(live.url("/v1/completions"), json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    headers, after = metrics_of(live.url("/metrics"))
    assert headers["content-type"].startswith("text/plain")
    assert total(after, "raypack:num_replicas") == 1
    ttft = "raypack:time_to_first_token_seconds_count"
    assert total(after, ttft) == total(before, ttft) + 1
    tokens = "raypack:generation_tokens_total"
    assert (
        total(after, tokens) == total(before, tokens) + answer.json()["usage"]["completion_tokens"]
    )
    ((labels, _),) = after["raypack:replica_num_requests_running"]
    assert labels["replica"] == answer.headers[REPLICA_HEADER]
    # the app behind API keys: /v1 needs one, /metrics does not
    assert requests.get(live.url("/v1/models", "auth"), timeout=60).status_code == 401
    assert requests.get(live.url("/metrics", "auth"), timeout=60).status_code == 200
