"""The app's /metrics: each replica records into a `MetricsRecorder`, hands out plain
`ReplicaSnapshot`s, and whoever answers /metrics merges the snapshots of all replicas and renders
them as Prometheus text (`render`), with vLLM's metric names under a `raypack:` prefix.

No Ray and no global state here: a recorder belongs to one replica's engine loop, a snapshot is
a frozen copy of it (cumulative since the replica started, so it can be asked for at any time,
by anyone, as often as wanted), and rendering builds its families afresh from the snapshots it
is given (prometheus_client's default registry is never touched).

Merging, across replicas: counters are summed, histograms are merged bucket by bucket (every
replica uses the same bounds), request gauges are summed, and KV-cache usage is the share of all
replicas' blocks in use. Per-replica gauges (`raypack:replica_*`, label `replica`) say where the
load is.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

PREFIX = "raypack:"
# Seconds; request-level latencies (TTFT, end to end, queueing) and per-token ones.
LATENCY_BUCKETS_S = (
    *(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
    *(2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
)
TOKEN_BUCKETS_S = (
    *(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08),
    *(0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0),
)

# name (after the prefix) -> (help, bucket bounds)
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "time_to_first_token_seconds": (
        "Time to first token: request arrival to its first generated token.",
        LATENCY_BUCKETS_S,
    ),
    "inter_token_latency_seconds": (
        "Time between consecutive generated tokens of a request (one sample per token).",
        TOKEN_BUCKETS_S,
    ),
    "time_per_output_token_seconds": (
        "Mean time per output token after the first, one sample per finished request.",
        TOKEN_BUCKETS_S,
    ),
    "e2e_request_latency_seconds": (
        "End-to-end request latency: arrival to its last token.",
        LATENCY_BUCKETS_S,
    ),
    "request_queue_time_seconds": (
        "Time a request waited in the staging queue before entering the engine.",
        LATENCY_BUCKETS_S,
    ),
}
# name (after the prefix, before _total) -> help
COUNTERS: dict[str, str] = {
    "prompt_tokens": "Prompt tokens of requests that got their first token.",
    "generation_tokens": "Generated tokens.",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache (not computed).",
    "num_preemptions": "Requests preempted by the engine (freed, to be recomputed).",
}


@dataclass
class Histogram:
    """Bucket counts (not cumulative: one per bound, the last for +Inf), their sum of values."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"bucket bounds must increase, got {self.bounds}")
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        if len(self.counts) != len(self.bounds) + 1:
            raise ValueError(
                f"{len(self.bounds)} bounds need {len(self.bounds) + 1} counts, "
                f"got {len(self.counts)}"
            )

    @property
    def count(self) -> int:
        """Values observed."""
        return sum(self.counts)

    def observe(self, value: float, times: int = 1) -> None:
        """Count `value` (`times` times) in the first bucket whose bound is >= it."""
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.total += value * times

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.total)

    def cumulative(self) -> list[tuple[str, float]]:
        """Prometheus buckets: (le, values <= le), ending with +Inf (the count)."""
        buckets, running = [], 0
        for bound, n in zip((*map(_le, self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            buckets.append((bound, float(running)))
        return buckets


def _le(bound: float) -> str:
    return repr(float(bound))


def merge_histograms(histograms: Sequence[Histogram]) -> Histogram:
    """Bucket-wise sum; every histogram must have the same bounds."""
    if not histograms:
        raise ValueError("no histograms to merge")
    bounds = histograms[0].bounds
    merged = Histogram(bounds)
    for histogram in histograms:
        if histogram.bounds != bounds:
            raise ValueError(f"cannot merge buckets {histogram.bounds} into {bounds}")
        merged.counts = [a + b for a, b in zip(merged.counts, histogram.counts, strict=True)]
        merged.total += histogram.total
    return merged


@dataclass(frozen=True)
class ReplicaSnapshot:
    """One replica's metrics at one moment: cumulative counters and histograms, current gauges."""

    replica: str
    model_name: str
    counters: dict[str, float]  # COUNTERS' names
    finished: dict[str, int]  # finish reason -> requests
    histograms: dict[str, Histogram]  # HISTOGRAMS' names
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # share of the KV blocks held by requests (0-1)
    kv_blocks: int = 0  # blocks in the KV pool (weighs kv_usage in a merge)


class MetricsRecorder:
    """What one replica's engine loop records; `snapshot` copies it with the current gauges."""

    def __init__(self) -> None:
        self.histograms = {name: Histogram(bounds) for name, (_, bounds) in HISTOGRAMS.items()}
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)
        self.finished: Counter[str] = Counter()

    def record_queued(self, queue_s: float) -> None:
        """A request entered the engine after `queue_s` seconds in the staging queue."""
        self.histograms["request_queue_time_seconds"].observe(queue_s)

    def record_first_token(self, ttft_s: float, prompt_tokens: int, cached_tokens: int) -> None:
        """A request got its first token: its TTFT and its prompt's prefix-cache lookup."""
        self.histograms["time_to_first_token_seconds"].observe(ttft_s)
        self.counters["prompt_tokens"] += prompt_tokens
        self.counters["prefix_cache_queries"] += prompt_tokens
        self.counters["prefix_cache_hits"] += cached_tokens

    def record_tokens(self, new_tokens: int, gap_s: float | None = None) -> None:
        """A request got `new_tokens` tokens in a step, `gap_s` after its previous token (None
        for its first tokens): each of them counts `gap_s / new_tokens` of inter-token time."""
        if new_tokens <= 0:
            return
        self.counters["generation_tokens"] += new_tokens
        if gap_s is not None:
            self.histograms["inter_token_latency_seconds"].observe(gap_s / new_tokens, new_tokens)

    def record_finished(self, finish_reason: str, latency_s: float, tpot_s: float | None) -> None:
        """A request finished: its reason, end-to-end latency and mean time per output token
        (None with fewer than two tokens)."""
        self.finished[finish_reason] += 1
        self.histograms["e2e_request_latency_seconds"].observe(latency_s)
        if tpot_s is not None:
            self.histograms["time_per_output_token_seconds"].observe(tpot_s)

    def snapshot(
        self,
        replica: str,
        model_name: str,
        *,
        running: int,
        waiting: int,
        kv_usage: float,
        kv_blocks: int,
        num_preemptions: int,
    ) -> ReplicaSnapshot:
        """A frozen copy with the gauges (and the engine's preemption count) given now."""
        return ReplicaSnapshot(
            replica=replica,
            model_name=model_name,
            counters={**self.counters, "num_preemptions": float(num_preemptions)},
            finished=dict(self.finished),
            histograms={name: h.copy() for name, h in self.histograms.items()},
            running=running,
            waiting=waiting,
            kv_usage=kv_usage,
            kv_blocks=kv_blocks,
        )


def merge(snapshots: Sequence[ReplicaSnapshot]) -> ReplicaSnapshot:
    """All replicas as one (replica ''): counters, finish reasons, histograms and request gauges
    summed; KV usage weighted by each replica's blocks."""
    if not snapshots:
        raise ValueError("no snapshots to merge")
    names = {s.model_name for s in snapshots}
    if len(names) > 1:
        raise ValueError(f"snapshots of different models: {sorted(names)}")
    finished: Counter[str] = Counter()
    for s in snapshots:
        finished.update(s.finished)
    blocks = sum(s.kv_blocks for s in snapshots)
    used = sum(s.kv_usage * s.kv_blocks for s in snapshots)
    return ReplicaSnapshot(
        replica="",
        model_name=snapshots[0].model_name,
        counters={n: sum(s.counters.get(n, 0.0) for s in snapshots) for n in COUNTERS},
        finished=dict(finished),
        histograms={
            name: merge_histograms([s.histograms[name] for s in snapshots]) for name in HISTOGRAMS
        },
        running=sum(s.running for s in snapshots),
        waiting=sum(s.waiting for s in snapshots),
        kv_usage=used / blocks if blocks else 0.0,
        kv_blocks=blocks,
    )


class _Families:
    """prometheus_client's collector interface over snapshots (what generate_latest reads)."""

    def __init__(self, snapshots: Sequence[ReplicaSnapshot]) -> None:
        self.snapshots = sorted(snapshots, key=lambda s: s.replica)

    def collect(self) -> Iterator[Metric]:
        if not self.snapshots:
            return
        app = merge(self.snapshots)
        model = [app.model_name]
        for name, (doc, _) in HISTOGRAMS.items():
            family = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"])
            histogram = app.histograms[name]
            family.add_metric(model, histogram.cumulative(), histogram.total)
            yield family
        for name, doc in COUNTERS.items():
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric(model, app.counters[name])
            yield counter
        success = CounterMetricFamily(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        for reason, n in sorted(app.finished.items()):
            success.add_metric([app.model_name, reason], n)
        yield success
        queries, hits = app.counters["prefix_cache_queries"], app.counters["prefix_cache_hits"]
        gauges = {
            "num_requests_running": ("Requests in the engines.", app.running),
            "num_requests_waiting": ("Requests in the staging queues.", app.waiting),
            "kv_cache_usage_perc": ("Share of all KV-cache blocks in use (0-1).", app.kv_usage),
            "prefix_cache_hit_rate": (
                "Prefix-cache hits over queries (tokens) since the replicas started (0-1).",
                hits / queries if queries else 0.0,
            ),
            "num_replicas": ("Replicas whose metrics this answer holds.", len(self.snapshots)),
        }
        for name, (doc, value) in gauges.items():
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            gauge.add_metric(model, value)
            yield gauge
        per_replica = {
            "replica_num_requests_running": ("Requests in this replica's engine.", "running"),
            "replica_num_requests_waiting": ("Requests in this replica's queue.", "waiting"),
            "replica_kv_cache_usage_perc": ("Share of this replica's KV blocks.", "kv_usage"),
        }
        for name, (doc, attribute) in per_replica.items():
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name", "replica"])
            for s in self.snapshots:
                gauge.add_metric([s.model_name, s.replica], getattr(s, attribute))
            yield gauge


def render(snapshots: Sequence[ReplicaSnapshot], accept: str = "") -> tuple[bytes, str]:
    """The replicas' metrics as an exposition body and its content type: Prometheus text, or
    OpenMetrics when the `accept` header asks for it (as prometheus_client's own endpoint)."""
    encoder, content_type = choose_encoder(accept)
    return encoder(_Families(snapshots)), content_type
