"""GET /metrics on live apps: Prometheus text of ALL the app's replicas.

Two replicas of the tiny model behind the prefix-routing front (conftest's shared
`two_replicas`; the front asks every replica): after completions that both replicas served
(`x-raypack-replica`), the TTFT histogram has counted every finished request more than before
them, and the generation-token counter has grown by the sum of their usage.completion_tokens
(tests/serve/replica_metrics.py; the same check without a front, where the replica that gets
/metrics asks its siblings, runs on the serve command's own two-replica app in
tests/serve/test_command.py). One replica (conftest's `main` app) answers from its own engine,
and /metrics needs no API key (as /health, as vLLM's). Timeouts are hang guards only."""

from __future__ import annotations

import pytest
import requests

from pipeline.serve.replicas import REPLICA_HEADER
from tests.serve.conftest import MODEL, Live
from tests.serve.replica_metrics import (
    PROMPTS,
    check_metrics_cover_both_replicas,
    metrics_of,
    total,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_metrics_of_two_replicas_behind_the_front_cover_both(two_replicas: str) -> None:
    check_metrics_cover_both_replicas(two_replicas, MODEL, front=True)


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
