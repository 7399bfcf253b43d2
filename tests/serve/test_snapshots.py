"""The /metrics pieces without Ray (pipeline/serve/snapshots.py): a replica's recorder, the
histogram and snapshot merge across replicas, the Prometheus text (parsed back with
prometheus_client's own parser), and the prefix front answering GET /metrics itself (under a
route prefix) or with a 503 when the replicas' snapshots cannot be had."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.serve.front import front_app, run_asgi
from pipeline.serve.guard import GuardLimits
from pipeline.serve.router import RoutedRequest
from pipeline.serve.snapshots import (
    HISTOGRAMS,
    Histogram,
    MetricsRecorder,
    ReplicaSnapshot,
    merge,
    merge_histograms,
    render,
)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, from Prometheus text."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(parsed: dict, name: str, **labels: str) -> float:
    return float(parsed[(name, tuple(sorted({"model_name": "m", **labels}.items())))])


def replica(name: str, ttfts: list[float], tokens: list[int], **gauges: Any) -> ReplicaSnapshot:
    """A replica whose requests had these TTFTs and generated these token counts (one finished
    request each, 10-token prompts with 4 cached)."""
    recorder = MetricsRecorder()
    for ttft, n in zip(ttfts, tokens, strict=True):
        recorder.record_queued(ttft / 2)
        recorder.record_first_token(ttft, prompt_tokens=10, cached_tokens=4)
        recorder.record_tokens(1)
        if n > 1:
            recorder.record_tokens(n - 1, gap_s=0.02 * (n - 1))
        recorder.record_finished("length", ttft + 0.1, 0.02 if n > 1 else None)
    defaults = dict(running=0, waiting=0, kv_usage=0.0, kv_blocks=100, num_preemptions=0)
    return recorder.snapshot(name, "m", **{**defaults, **gauges})


def test_histogram_counts_values_at_a_bound_in_that_bucket() -> None:
    histogram = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 7.0):
        histogram.observe(v)
    histogram.observe(0.2, times=3)
    assert histogram.counts == [2, 5, 1]
    assert histogram.count == 8
    assert histogram.total == pytest.approx(0.05 + 0.1 + 0.5 + 1.0 + 7.0 + 0.6)
    assert histogram.cumulative() == [("0.1", 2.0), ("1.0", 7.0), ("+Inf", 8.0)]
    with pytest.raises(ValueError, match="increase"):
        Histogram((1.0, 0.5))
    with pytest.raises(ValueError, match="counts"):
        Histogram((1.0,), [1, 2, 3])


def test_histograms_merge_bucket_by_bucket_and_only_with_equal_bounds() -> None:
    a, b = Histogram((1.0, 2.0), [1, 0, 2], 7.0), Histogram((1.0, 2.0), [0, 3, 1], 9.5)
    merged = merge_histograms([a, b])
    assert merged.counts == [1, 3, 3] and merged.total == 16.5
    assert a.counts == [1, 0, 2]  # the inputs are left alone
    with pytest.raises(ValueError, match="cannot merge"):
        merge_histograms([a, Histogram((1.0, 3.0))])


def test_snapshots_merge_sums_and_weighs_kv_usage_by_blocks() -> None:
    a = replica("a", [0.03, 0.2], [5, 1], running=2, waiting=1, kv_usage=0.5, kv_blocks=100)
    b = replica("b", [0.5], [3], running=1, kv_usage=0.1, kv_blocks=300, num_preemptions=2)
    app = merge([a, b])
    assert app.histograms["time_to_first_token_seconds"].count == 3
    assert app.histograms["inter_token_latency_seconds"].count == (5 - 1) + (3 - 1)
    assert app.histograms["time_per_output_token_seconds"].count == 2  # one had one token
    assert app.counters["generation_tokens"] == 9
    assert app.counters["prompt_tokens"] == app.counters["prefix_cache_queries"] == 30
    assert app.counters["prefix_cache_hits"] == 12
    assert app.counters["num_preemptions"] == 2
    assert app.finished == {"length": 3}
    assert (app.running, app.waiting, app.kv_blocks) == (3, 1, 400)
    assert app.kv_usage == pytest.approx((50 + 30) / 400)
    with pytest.raises(ValueError, match="different models"):
        merge([a, ReplicaSnapshot("c", "other", {}, {}, a.histograms)])


def test_a_snapshot_is_a_copy_the_recorder_goes_on_without() -> None:
    recorder = MetricsRecorder()
    recorder.record_first_token(0.1, 5, 0)
    gauges = dict(running=0, waiting=0, kv_usage=0.0, kv_blocks=1, num_preemptions=0)
    before = recorder.snapshot("r", "m", **gauges)  # type: ignore[arg-type]
    recorder.record_first_token(0.1, 5, 0)
    assert before.histograms["time_to_first_token_seconds"].count == 1
    assert recorder.snapshot("r", "m", **gauges).counters["prompt_tokens"] == 10  # type: ignore[arg-type]


def test_rendered_text_parses_with_vllm_names_and_per_replica_gauges() -> None:
    a = replica("a", [0.03, 0.2], [5, 1], running=2, kv_usage=0.5)
    b = replica("b", [0.5], [3], waiting=4)
    body, content_type = render([b, a])
    assert content_type.startswith("text/plain; version=0.0.4")
    parsed = samples(body.decode())
    assert value(parsed, "raypack:time_to_first_token_seconds_count") == 3
    assert value(parsed, "raypack:time_to_first_token_seconds_bucket", le="0.05") == 1
    assert value(parsed, "raypack:time_to_first_token_seconds_bucket", le="+Inf") == 3
    assert value(parsed, "raypack:time_to_first_token_seconds_sum") == pytest.approx(0.73)
    assert value(parsed, "raypack:generation_tokens_total") == 9
    assert value(parsed, "raypack:prompt_tokens_total") == 30
    assert value(parsed, "raypack:prefix_cache_hits_total") == 12
    assert value(parsed, "raypack:prefix_cache_queries_total") == 30
    assert value(parsed, "raypack:prefix_cache_hit_rate") == pytest.approx(0.4)
    assert value(parsed, "raypack:request_success_total", finished_reason="length") == 3
    assert value(parsed, "raypack:num_requests_running") == 2
    assert value(parsed, "raypack:num_requests_waiting") == 4
    assert value(parsed, "raypack:kv_cache_usage_perc") == pytest.approx(0.25)
    assert value(parsed, "raypack:num_replicas") == 2
    assert value(parsed, "raypack:replica_num_requests_waiting", replica="b") == 4
    assert value(parsed, "raypack:replica_kv_cache_usage_perc", replica="a") == 0.5
    names = {name for name, _ in parsed}
    for histogram in HISTOGRAMS:
        assert f"raypack:{histogram}_count" in names
    assert render([])[0] == b""  # no replica answered: no samples, still valid text


def test_openmetrics_when_the_scraper_asks_for_it() -> None:
    body, content_type = render([replica("a", [0.1], [2])], "application/openmetrics-text")
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")


def get(app: Any, path: str, root_path: str = "") -> list[dict[str, Any]]:
    scope = {"type": "http", "method": "GET", "path": path, "root_path": root_path}
    scope |= {"headers": [], "client": ("10.0.0.1", 1)}
    request = RoutedRequest(scope=scope, body=b"")

    async def collect() -> list[dict[str, Any]]:
        return [message async for message in run_asgi(app, request)]

    return asyncio.run(collect())


LIMITS = GuardLimits(
    max_body_bytes=100, body_timeout_s=1.0, max_slow_bodies_per_client=2, max_slow_bodies=3
)


def test_the_front_answers_metrics_itself_under_its_route_prefix() -> None:
    passed_on: list[str] = []

    async def forward(request: RoutedRequest) -> Any:
        passed_on.append(request.scope["path"])
        yield {"type": "http.response.start", "status": 204, "headers": []}
        yield {"type": "http.response.body", "body": b""}

    async def snapshots() -> list[ReplicaSnapshot]:
        return [replica("a", [0.1], [2]), replica("b", [0.2, 0.3], [4, 4])]

    app = front_app(forward, LIMITS, snapshots)
    start, body = get(app, "/app/metrics", root_path="/app")
    assert start["status"] == 200 and not passed_on
    assert dict(start["headers"])[b"content-type"].startswith(b"text/plain")
    parsed = samples(body["body"].decode())
    assert value(parsed, "raypack:time_to_first_token_seconds_count") == 3
    assert value(parsed, "raypack:generation_tokens_total") == 10
    # anything else goes on to the replicas, as before
    assert get(app, "/app/health", root_path="/app")[0]["status"] == 204
    assert passed_on == ["/app/health"]

    async def failing() -> list[ReplicaSnapshot]:
        raise TimeoutError("Timed out waiting for broadcast results.")

    start, body = get(front_app(forward, LIMITS, failing), "/metrics")
    assert start["status"] == 503 and b"metrics could not be collected" in body["body"]
