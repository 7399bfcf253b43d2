"""Per-request latency against two SLOs (TTFT and TPOT) and goodput (benchmarks).

TTFT is the time from a request's arrival to its first token; TPOT its time per output token
after the first, (finish - first token) / (output tokens - 1). A request meets the SLOs when
both are within their bound (one output token: TTFT only); goodput is such requests per second
of the replay's window (DistServe's definition). A request that never finished meets neither
and counts as infinitely late in the percentiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Timing:
    """One request's clock readings (seconds, one clock); None: it never got there."""

    arrival_s: float
    first_token_s: float | None
    finished_s: float | None
    output_tokens: int

    @property
    def ttft_s(self) -> float:
        """Arrival to first token (inf when no token came)."""
        return math.inf if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Seconds per output token after the first (0 with one token; inf unfinished)."""
        if self.first_token_s is None or self.finished_s is None:
            return math.inf
        if self.output_tokens <= 1:
            return 0.0
        return (self.finished_s - self.first_token_s) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """numpy's percentile, where unfinished requests (inf) make any rank they reach inf."""
    data = np.array(values, dtype=float)
    finite = data[np.isfinite(data)]
    if finite.size == 0:
        return math.inf if data.size else math.nan
    big = float(finite.max()) + 1.0
    result = float(np.percentile(np.where(np.isfinite(data), data, big * 1e9), q))
    return result if result <= big - 1.0 else math.inf


def summarise(
    timings: list[Timing], ttft_slo_s: float, tpot_slo_s: float, window_s: float
) -> dict[str, float]:
    """p50/p95 TTFT and TPOT, the share of requests meeting both SLOs, and goodput (those
    requests per second of `window_s`)."""
    ttft = [t.ttft_s for t in timings]
    tpot = [t.tpot_s for t in timings]
    good = sum(1 for a, b in zip(ttft, tpot, strict=True) if a <= ttft_slo_s and b <= tpot_slo_s)
    return {
        "requests": len(timings),
        "finished": sum(1 for t in timings if t.finished_s is not None),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p95_s": percentile(tpot, 95),
        "ttft_met": sum(1 for a in ttft if a <= ttft_slo_s) / max(len(timings), 1),
        "tpot_met": sum(1 for b in tpot if b <= tpot_slo_s) / max(len(timings), 1),
        "slo_met": good / max(len(timings), 1),
        "goodput_req_s": good / window_s,
    }
