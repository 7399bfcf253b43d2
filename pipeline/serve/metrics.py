"""Prometheus metrics of one replica: through Ray Serve's metrics API, and into the replica's
own `MetricsRecorder` (pipeline/serve/snapshots.py) that the app's GET /metrics reads.

Created in the replica (never at import), so two replicas or two apps never share state. Ray
exports the `raypack_serve_*` metrics on each node's metrics port with the replica's tags added;
/metrics answers the `raypack:*` ones (vLLM's names) of all the app's replicas.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray.serve import metrics

from pipeline.serve.snapshots import MetricsRecorder, ReplicaSnapshot

logger = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 10.0  # for all replicas' snapshots of one GET /metrics

_LATENCY_BUCKETS_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
_TPOT_BUCKETS_S = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0]


class ServeMetrics:
    """The serving metrics: TTFT, TPOT, latency, queue depth, N_t, tokens/s, prefix-cache hits."""

    def __init__(self, tokens_per_s_window_s: float = 5.0) -> None:
        self.ttft = metrics.Histogram(
            "raypack_serve_ttft_seconds",
            "Time to first token: request arrival to its first generated token.",
            boundaries=_LATENCY_BUCKETS_S,
        )
        self.tpot = metrics.Histogram(
            "raypack_serve_time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per finished request.",
            boundaries=_TPOT_BUCKETS_S,
        )
        self.latency = metrics.Histogram(
            "raypack_serve_e2e_latency_seconds",
            "Request arrival to its last token.",
            boundaries=_LATENCY_BUCKETS_S,
        )
        self.queue_depth = metrics.Gauge(
            "raypack_serve_queue_depth", "Requests waiting in the staging queue."
        )
        self.running = metrics.Gauge(
            "raypack_serve_running_requests", "Requests admitted to the engine, not finished."
        )
        self.threshold = metrics.Gauge(
            "raypack_serve_admission_threshold", "The admission controller's N_t."
        )
        self.tokens_per_s = metrics.Gauge(
            "raypack_serve_generated_tokens_per_second",
            "Generated tokens per second over the last few seconds.",
        )
        self.generated_tokens = metrics.Counter(
            "raypack_serve_generated_tokens_total", "Tokens generated."
        )
        self.prompt_tokens = metrics.Counter(
            "raypack_serve_prompt_tokens_total", "Prompt tokens of admitted requests."
        )
        self.cached_tokens = metrics.Counter(
            "raypack_serve_prefix_cache_hit_tokens_total",
            "Prompt tokens served from the prefix cache instead of being computed.",
        )
        self.finished = metrics.Counter(
            "raypack_serve_requests_finished_total",
            "Finished requests by finish reason.",
            tag_keys=("finish_reason",),
        )
        self.rejected = metrics.Counter(
            "raypack_serve_requests_rejected_total",
            "Requests answered with an error, by HTTP status.",
            tag_keys=("status",),
        )
        self.recorder = MetricsRecorder()  # what GET /metrics reads (snapshots.py)
        self._window_s = tokens_per_s_window_s
        self._window_start = time.monotonic()
        self._window_tokens = 0

    def record_step(self, new_tokens: int, waiting: int, running: int, threshold: int) -> None:
        """After each engine step: tokens generated in it and the queue state."""
        self.queue_depth.set(waiting)
        self.running.set(running)
        self.threshold.set(threshold)
        if new_tokens:
            self.generated_tokens.inc(new_tokens)
        self._window_tokens += new_tokens
        now = time.monotonic()
        if now - self._window_start >= self._window_s:
            self.tokens_per_s.set(self._window_tokens / (now - self._window_start))
            self._window_start, self._window_tokens = now, 0

    def record_queued(self, queue_s: float) -> None:
        """A request entered the engine after `queue_s` seconds in the staging queue."""
        self.recorder.record_queued(queue_s)

    def record_first_token(
        self, ttft_s: float, prompt_tokens: int = 0, cached_tokens: int = 0
    ) -> None:
        """A request got its first token after `ttft_s` seconds (its prompt had
        `prompt_tokens` tokens, `cached_tokens` of them from the prefix cache)."""
        self.ttft.observe(ttft_s)
        self.recorder.record_first_token(ttft_s, prompt_tokens, cached_tokens)

    def record_tokens(self, new_tokens: int, gap_s: float | None) -> None:
        """A request got `new_tokens` tokens in a step, `gap_s` after its previous one."""
        self.recorder.record_tokens(new_tokens, gap_s)

    def record_finished(
        self,
        finish_reason: str,
        latency_s: float,
        tpot_s: float | None,
        prompt_tokens: int,
        cached_tokens: int,
    ) -> None:
        """A request finished."""
        self.finished.inc(tags={"finish_reason": finish_reason})
        self.recorder.record_finished(finish_reason, latency_s, tpot_s)
        self.latency.observe(latency_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if cached_tokens:
            self.cached_tokens.inc(cached_tokens)

    def record_rejected(self, status: int) -> None:
        """A request was answered with an error status."""
        self.rejected.inc(tags={"status": str(status)})


async def app_snapshots(
    handle: Any, timeout_s: float = SNAPSHOT_TIMEOUT_S
) -> list[ReplicaSnapshot]:
    """Every running replica's `metrics_snapshot()`, through Serve's broadcast on `handle` (the
    engine deployment's handle: one call per replica, whichever router the handle has). A
    replica whose call fails is left out (logged); TimeoutError when they take over
    `timeout_s`."""
    results = await handle.broadcast("metrics_snapshot").results_async(
        timeout_s=timeout_s, return_exceptions=True
    )
    snapshots = []
    for result in results:
        if isinstance(result, BaseException):
            logger.warning("a replica's metrics are missing: %r", result)
        else:
            snapshots.append(result)
    return snapshots
