"""GET /metrics of a live two-replica app covers BOTH replicas: the check that
tests/serve/test_metrics_http.py runs on conftest's `two_replicas` (behind the prefix-routing
front) and tests/serve/test_command.py on the serve command's own app (no front, where the
replica that gets /metrics asks its siblings)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import requests
from prometheus_client.parser import text_string_to_metric_families

from pipeline.serve.replicas import REPLICA_HEADER

PROMPTS = [f"Request number {i} says hello to" for i in range(6)]

Samples = dict[str, list[tuple[dict[str, str], float]]]


def metrics_of(url: str) -> tuple[Mapping[str, str], Samples]:
    """GET /metrics: its headers, and sample name -> [(labels, value)]."""
    answer = requests.get(url, timeout=60)
    assert answer.status_code == 200, answer.text
    parsed: Samples = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            parsed.setdefault(sample.name, []).append((sample.labels, sample.value))
    return answer.headers, parsed


def total(parsed: Samples, name: str) -> float:
    return sum(v for _, v in parsed.get(name, []))  # 0 before any request


def check_metrics_cover_both_replicas(base: str, model: str, front: bool) -> None:
    """Completions until both replicas of the app at `base` served some (`x-raypack-replica`),
    then /metrics: the TTFT histogram has counted every finished request more than before them
    and the generation-token counter has grown by the sum of their usage.completion_tokens;
    `front`: whether the prefix-routing front answers /metrics (no replica header) or a
    replica does. Counts are from what /metrics said before (the app may have served others)."""

    def ask(i: int) -> tuple[str, int]:
        body = {"model": model, "prompt": PROMPTS[i], "max_tokens": 2 + i, "temperature": 0}
        answer = requests.post(f"{base}/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.headers[REPLICA_HEADER], answer.json()["usage"]["completion_tokens"]

    _, before = metrics_of(f"{base}/metrics")
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

    headers, parsed = metrics_of(f"{base}/metrics")
    assert headers["content-type"].startswith("text/plain; version=0.0.4"), headers
    # the front answers itself; without it, the replica that got the request asked the others
    assert (REPLICA_HEADER in headers) != front, headers

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
