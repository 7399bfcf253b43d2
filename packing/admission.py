"""The online admission rule: when do the prompts waiting in the staging queue enter the engine.

New requests wait in a staging queue; between engine steps the server asks the controller how
many of them to hand to the engine together (one packed prefill). Three policies:

- `immediate`: admit everything waiting at every step.
- `fixed` (Prepacking-style window): admit when `window_requests` are waiting or the oldest has
  waited `window_s`.
- `aimd`: admit when the queue reaches a threshold N_t in [n_min, n_max]. N_t follows the
  smoothed (EWMA) p95 TTFT: additive increase by `alpha` while it is below the band
  [ttft_low_s, ttft_high_s], multiplicative decrease by `beta` above it, unchanged inside
  (hysteresis). A burst override admits at once when the queue depth or the EWMA arrival rate
  passes its threshold, and a timeout bounds how long any request waits. N_t starts at n_min.
  Waiting only pays if the group can fill: once the arrivals expected before the timeout (at
  the smoothed inter-arrival gap) can no longer bring the queue to N_t, the group goes in now
  (`no_fill`) instead of idling to the timeout. At low load that makes aimd admit like
  immediate, whatever N_t the slack has grown.

Pure code: no torch, no ray, no clocks. Every input (the time, the queue, observed TTFTs,
arrivals) is an explicit argument, so the rule is tested without a server.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

AdmissionPolicy = Literal["immediate", "fixed", "aimd"]
AdmitReason = Literal[
    "empty",
    "wait",
    "immediate",
    "window",
    "threshold",
    "burst_depth",
    "burst_rate",
    "no_fill",
    "timeout",
]
POLICIES: tuple[AdmissionPolicy, ...] = ("immediate", "fixed", "aimd")

_MIN_GAP_S = 1e-6  # two arrivals at the same instant count as this far apart

_TIME_SLACK_S = 1e-9  # below any clock's resolution that matters here


@dataclass(frozen=True)
class AdmissionConfig:
    """Every knob of the admission rule. Times are seconds, rates requests per second."""

    policy: AdmissionPolicy = "aimd"
    # fixed window: admit when this many wait ...
    window_requests: int = 4
    # ... or when the oldest waiting request has waited this long.
    window_s: float = 0.05
    # aimd: bounds of the threshold N_t (cold start at n_min).
    n_min: int = 1
    n_max: int = 16
    # aimd: additive increase of N_t per update while the smoothed p95 TTFT is under ttft_low_s.
    alpha: float = 1.0
    # aimd: multiplicative decrease (N_t <- N_t * beta) while it is over ttft_high_s.
    beta: float = 0.5
    # aimd: the hysteresis band on the smoothed p95 TTFT; inside it N_t is left alone.
    ttft_low_s: float = 0.5
    ttft_high_s: float = 1.0
    # aimd: weight of the newest p95 sample in the EWMA (1 = no smoothing).
    ttft_ewma_weight: float = 0.2
    # aimd: how many recent TTFTs the p95 is taken over.
    ttft_window: int = 64
    # aimd burst override: admit everything when this many requests wait ...
    burst_queue_depth: int = 32
    # ... or when the EWMA arrival rate reaches this many requests per second.
    burst_arrival_rate: float = 50.0
    # aimd: weight of the newest inter-arrival gap in the arrival-rate EWMA.
    arrival_ewma_weight: float = 0.1
    # aimd timeout: admit everything once the oldest waiting request has waited this long.
    max_wait_s: float = 0.25

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        _at_least("window_requests", self.window_requests, 1)
        _at_least("n_min", self.n_min, 1)
        _at_least("n_max", self.n_max, self.n_min)
        _at_least("burst_queue_depth", self.burst_queue_depth, 1)
        _at_least("ttft_window", self.ttft_window, 1)
        if self.alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")
        if not 0 < self.beta < 1:
            raise ValueError(f"beta must be in (0, 1), got {self.beta}")
        if not 0 <= self.ttft_low_s <= self.ttft_high_s:
            raise ValueError(
                "need 0 <= ttft_low_s <= ttft_high_s, got "
                f"ttft_low_s={self.ttft_low_s}, ttft_high_s={self.ttft_high_s}"
            )
        for name in ("ttft_ewma_weight", "arrival_ewma_weight"):
            weight = getattr(self, name)
            if not 0 < weight <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {weight}")
        for name in ("window_s", "max_wait_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.burst_arrival_rate <= 0:
            raise ValueError(f"burst_arrival_rate must be > 0, got {self.burst_arrival_rate}")


@dataclass(frozen=True)
class AdmissionDecision:
    """What to do now: admit `count` waiting requests (0: keep waiting) and why.

    `wake_at` is when the answer changes with no new input (a window or timeout expiring);
    None when only a new arrival or observation can change it.
    """

    count: int
    reason: AdmitReason
    wake_at: float | None = None


class AdmissionController:
    """The admission state machine: N_t, the smoothed p95 TTFT and the arrival-rate estimate.

    Feed it `observe_arrival(now)` for each new request and `observe_ttfts(ttfts)` with the
    TTFTs that completed in a step; ask `decide(now, queue_depth, oldest_arrival)` between steps.
    """

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._threshold = float(config.n_min)
        self._recent_ttfts: deque[float] = deque(maxlen=config.ttft_window)
        self._smoothed_p95: float | None = None
        self._gap_ewma: float | None = None
        self._last_arrival: float | None = None

    @property
    def threshold(self) -> int:
        """N_t: how many waiting requests the aimd policy gathers before a packed prefill."""
        return int(self._threshold)

    @property
    def smoothed_p95_ttft(self) -> float | None:
        """The EWMA of the p95 TTFT over the recent window; None before the first TTFT."""
        return self._smoothed_p95

    def arrival_rate(self, now: float) -> float:
        """EWMA arrival rate in requests/s; it decays once arrivals stop."""
        if self._gap_ewma is None or self._last_arrival is None:
            return 0.0
        gap = max(self._gap_ewma, now - self._last_arrival, _MIN_GAP_S)
        return 1.0 / gap

    def observe_arrival(self, now: float) -> None:
        """Record that a request entered the staging queue at `now`."""
        if self._last_arrival is not None:
            gap = max(now - self._last_arrival, _MIN_GAP_S)
            if self._gap_ewma is None:
                self._gap_ewma = gap
            else:
                weight = self.config.arrival_ewma_weight
                self._gap_ewma = (1 - weight) * self._gap_ewma + weight * gap
        self._last_arrival = now if self._last_arrival is None else max(now, self._last_arrival)

    def observe_ttfts(self, ttfts: Iterable[float]) -> None:
        """Record the TTFTs (seconds) that completed in one step and apply one AIMD update."""
        new = [t for t in ttfts if t >= 0 and math.isfinite(t)]
        if not new:
            return
        self._recent_ttfts.extend(new)
        p95 = percentile(list(self._recent_ttfts), 95.0)
        if self._smoothed_p95 is None:
            self._smoothed_p95 = p95
        else:
            weight = self.config.ttft_ewma_weight
            self._smoothed_p95 = (1 - weight) * self._smoothed_p95 + weight * p95
        self._threshold = next_threshold(self.config, self._threshold, self._smoothed_p95)

    def decide(
        self, now: float, queue_depth: int, oldest_arrival: float | None
    ) -> AdmissionDecision:
        """How many of the `queue_depth` waiting requests to admit now (all or none)."""
        cfg = self.config
        if queue_depth <= 0 or oldest_arrival is None:
            return AdmissionDecision(0, "empty")
        # Compare against the same sums as wake_at, so waking at wake_at always admits.
        window_end = oldest_arrival + cfg.window_s
        timeout_at = oldest_arrival + cfg.max_wait_s
        if cfg.policy == "immediate":
            return AdmissionDecision(queue_depth, "immediate")
        if cfg.policy == "fixed":
            if queue_depth >= cfg.window_requests or now >= window_end:
                return AdmissionDecision(queue_depth, "window")
            return AdmissionDecision(0, "wait", window_end)
        if queue_depth >= self.threshold:
            return AdmissionDecision(queue_depth, "threshold")
        if queue_depth >= cfg.burst_queue_depth:
            return AdmissionDecision(queue_depth, "burst_depth")
        if self.arrival_rate(now) >= cfg.burst_arrival_rate:
            return AdmissionDecision(queue_depth, "burst_rate")
        if now >= timeout_at:
            return AdmissionDecision(queue_depth, "timeout")
        fill_by = self._fill_deadline(queue_depth, timeout_at)
        # A nanosecond of slack: gaps summed in floats can leave fill_by an ulp past `now`
        # when the queue certainly cannot fill (arrivals exactly max_wait_s apart).
        if now >= fill_by - _TIME_SLACK_S:
            return AdmissionDecision(queue_depth, "no_fill")
        return AdmissionDecision(0, "wait", fill_by)

    def _fill_deadline(self, queue_depth: int, timeout_at: float) -> float:
        """The last moment the queue can still be expected to reach N_t by the timeout: the
        missing requests arrive one smoothed gap apart. Without a gap estimate (fewer than
        two arrivals seen) there is no evidence either way, so the timeout."""
        if self._gap_ewma is None:
            return timeout_at
        missing = self.threshold - queue_depth
        return min(timeout_at, timeout_at - missing * self._gap_ewma)


def next_threshold(config: AdmissionConfig, threshold: float, smoothed_p95_ttft: float) -> float:
    """One AIMD step of N_t given the smoothed p95 TTFT; the result stays in [n_min, n_max]."""
    if smoothed_p95_ttft < config.ttft_low_s:
        threshold = threshold + config.alpha
    elif smoothed_p95_ttft > config.ttft_high_s:
        threshold = threshold * config.beta
    return min(float(config.n_max), max(float(config.n_min), threshold))


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation, like numpy's default."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _at_least(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
