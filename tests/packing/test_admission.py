"""The admission rule: unit cases and properties (bounds, AIMD direction, burst, timeout)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from packing.admission import (
    AdmissionConfig,
    AdmissionController,
    next_threshold,
    percentile,
)

BAND = dict(ttft_low_s=0.5, ttft_high_s=1.0)


def aimd(**overrides: object) -> AdmissionController:
    """An aimd controller with the test band and any knob overridden."""
    kwargs: dict[str, object] = dict(policy="aimd", n_min=1, n_max=16, **BAND)
    kwargs.update(overrides)
    return AdmissionController(AdmissionConfig(**kwargs))  # type: ignore[arg-type]


def test_cold_start_at_n_min() -> None:
    ctl = aimd(n_min=3)
    assert ctl.threshold == 3
    assert ctl.smoothed_p95_ttft is None
    assert ctl.arrival_rate(0.0) == 0.0


def test_empty_queue_admits_nothing() -> None:
    for policy in ("immediate", "fixed", "aimd"):
        ctl = AdmissionController(AdmissionConfig(policy=policy))  # type: ignore[arg-type]
        assert ctl.decide(1.0, 0, None).count == 0


def test_immediate_admits_everything() -> None:
    ctl = AdmissionController(AdmissionConfig(policy="immediate"))
    decision = ctl.decide(10.0, 3, 10.0)
    assert (decision.count, decision.reason) == (3, "immediate")


def test_fixed_window_by_count_and_by_time() -> None:
    ctl = AdmissionController(AdmissionConfig(policy="fixed", window_requests=4, window_s=0.1))
    waiting = ctl.decide(1.0, 3, 0.95)
    assert waiting.count == 0 and waiting.wake_at == pytest.approx(1.05)
    assert ctl.decide(1.0, 4, 0.99).count == 4
    assert ctl.decide(1.06, 3, 0.95).reason == "window"


def test_aimd_threshold_and_timeout() -> None:
    ctl = aimd(n_min=2, max_wait_s=0.2, burst_arrival_rate=1e9)
    assert ctl.decide(5.0, 1, 5.0) == ctl.decide(5.0, 1, 5.0)
    wait = ctl.decide(5.0, 1, 5.0)
    assert wait.count == 0 and wait.reason == "wait" and wait.wake_at == pytest.approx(5.2)
    assert ctl.decide(5.0, 2, 5.0).reason == "threshold"
    timeout = ctl.decide(5.2, 1, 5.0)
    assert (timeout.count, timeout.reason) == (1, "timeout")


def test_aimd_waits_only_while_the_group_can_fill() -> None:
    ctl = aimd(n_min=4, max_wait_s=0.5, burst_arrival_rate=1e9, arrival_ewma_weight=1.0)
    ctl.observe_arrival(0.0)
    ctl.observe_arrival(0.1)  # one arrival every 0.1 s
    # three more needed, 0.1 s apart: they can still come by the timeout (0.5 s) until 0.2 s
    wait = ctl.decide(0.1, 1, 0.1)
    assert (wait.count, wait.reason) == (0, "wait") and wait.wake_at == pytest.approx(0.3)
    assert ctl.decide(0.3, 1, 0.1).reason == "no_fill"
    assert ctl.decide(0.1, 3, 0.1).wake_at == pytest.approx(0.5)  # one missing
    ctl.observe_arrival(2.1)  # now one every 2 s: no group can fill, admit at once
    assert ctl.decide(2.1, 1, 2.1).reason == "no_fill"


def test_aimd_increase_decrease_and_hysteresis() -> None:
    ctl = aimd(ttft_ewma_weight=1.0, ttft_window=1, alpha=2.0, beta=0.5)
    ctl.observe_ttfts([0.1])  # below the band: +alpha
    assert ctl.threshold == 3
    ctl.observe_ttfts([0.7])  # inside: unchanged
    assert ctl.threshold == 3
    ctl.observe_ttfts([2.0])  # above: *beta
    assert ctl.threshold == 1
    ctl.observe_ttfts([])  # no observation, no update
    assert ctl.threshold == 1


def test_burst_override_by_depth_and_by_rate() -> None:
    ctl = aimd(n_min=8, burst_queue_depth=5, burst_arrival_rate=100.0, max_wait_s=10.0)
    assert ctl.decide(0.0, 5, 0.0).reason == "burst_depth"
    for i in range(20):
        ctl.observe_arrival(i * 0.001)  # 1000 requests/s
    assert ctl.arrival_rate(0.02) > 100.0
    assert ctl.decide(0.02, 2, 0.019).reason == "burst_rate"
    # the estimate decays once arrivals stop
    assert ctl.arrival_rate(5.0) == pytest.approx(1 / (5.0 - 0.019))
    assert ctl.decide(5.0, 2, 4.99).reason == "wait"


def test_percentile_matches_numpy() -> None:
    values = [0.3, 0.1, 5.0, 2.0, 0.7]
    for q in (0, 50, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    with pytest.raises(ValueError):
        percentile([], 50)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(policy="lifo"),
        dict(n_min=0),
        dict(n_min=4, n_max=3),
        dict(beta=1.0),
        dict(alpha=0.0),
        dict(ttft_low_s=2.0, ttft_high_s=1.0),
        dict(ttft_ewma_weight=0.0),
        dict(max_wait_s=-1.0),
        dict(burst_arrival_rate=0.0),
    ],
)
def test_config_rejects_bad_knobs(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        AdmissionConfig(**kwargs)  # type: ignore[arg-type]


configs = st.builds(
    AdmissionConfig,
    policy=st.just("aimd"),
    n_min=st.integers(1, 8),
    n_max=st.integers(8, 64),
    alpha=st.floats(0.1, 4.0),
    beta=st.floats(0.1, 0.9),
    ttft_low_s=st.floats(0.01, 1.0),
    ttft_high_s=st.floats(1.0, 3.0),
    ttft_ewma_weight=st.floats(0.05, 1.0),
    ttft_window=st.integers(1, 100),
    burst_queue_depth=st.integers(1, 100),
    burst_arrival_rate=st.floats(1.0, 1000.0),
    max_wait_s=st.floats(0.0, 2.0),
)
events = st.lists(
    st.one_of(
        st.tuples(st.just("ttft"), st.lists(st.floats(0.0, 10.0), max_size=5)),
        st.tuples(st.just("arrive"), st.floats(0.0, 0.5)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(configs, events)
def test_threshold_stays_in_bounds(config: AdmissionConfig, trace: list) -> None:
    ctl = AdmissionController(config)
    now = 0.0
    for kind, value in trace:
        if kind == "ttft":
            ctl.observe_ttfts(value)
        else:
            now += value
            ctl.observe_arrival(now)
        assert config.n_min <= ctl.threshold <= config.n_max


@settings(max_examples=100, deadline=None)
@given(configs, st.integers(0, 64))
def test_sustained_violation_drives_threshold_to_n_min(config: AdmissionConfig, start: int) -> None:
    ctl = AdmissionController(config)
    for _ in range(start):  # first push N_t up with slack
        ctl.observe_ttfts([0.0])
    for _ in range(400):
        previous = ctl.threshold
        ctl.observe_ttfts([config.ttft_high_s * 10 + 1])
        smoothed = ctl.smoothed_p95_ttft
        assert smoothed is not None
        if smoothed > config.ttft_high_s:  # past the transient the window still remembers
            assert ctl.threshold <= previous
    assert ctl.threshold == config.n_min


@settings(max_examples=100, deadline=None)
@given(configs)
def test_sustained_slack_drives_threshold_to_n_max(config: AdmissionConfig) -> None:
    ctl = AdmissionController(config)
    for _ in range(2000):
        previous = ctl.threshold
        ctl.observe_ttfts([config.ttft_low_s / 2])
        assert ctl.threshold >= previous
    assert ctl.threshold == config.n_max


@settings(max_examples=200, deadline=None)
@given(configs, st.integers(1, 200), st.floats(0.0, 5.0), st.floats(0.0, 5.0))
def test_burst_and_timeout_always_admit_all(
    config: AdmissionConfig, depth: int, oldest: float, waited: float
) -> None:
    ctl = AdmissionController(config)
    now = oldest + waited
    decision = ctl.decide(now, depth, oldest)
    assert decision.count in (0, depth)
    if depth >= config.burst_queue_depth or waited >= config.max_wait_s:
        assert decision.count == depth
    if decision.count == 0:
        assert decision.wake_at is not None and decision.wake_at > now
        assert decision.wake_at - oldest == pytest.approx(config.max_wait_s)


@settings(max_examples=100, deadline=None)
@given(configs, st.floats(0.0, 10.0))
def test_next_threshold_direction(config: AdmissionConfig, p95: float) -> None:
    mid = (config.n_min + config.n_max) / 2
    new = next_threshold(config, mid, p95)
    assert config.n_min <= new <= config.n_max
    if p95 < config.ttft_low_s:
        assert new >= mid
    elif p95 > config.ttft_high_s:
        assert new <= mid
    else:
        assert new == mid


@settings(max_examples=200, deadline=None)
@given(configs, st.floats(0.0, 1e6), st.integers(1, 200))
def test_waking_at_wake_at_admits(config: AdmissionConfig, oldest: float, depth: int) -> None:
    """No float round-off can make the loop wake at wake_at and be told to wait again."""
    for policy in ("fixed", "aimd"):
        ctl = AdmissionController(replace(config, policy=policy))  # type: ignore[arg-type]
        first = ctl.decide(oldest, depth, oldest)
        if first.count == 0:
            assert first.wake_at is not None
            assert ctl.decide(first.wake_at, depth, oldest).count == depth


@settings(max_examples=200, deadline=None)
@given(configs, st.lists(st.floats(0.0, 0.5), min_size=1, max_size=30), st.integers(1, 200))
def test_waiting_never_outlasts_the_timeout(
    config: AdmissionConfig, gaps: list[float], depth: int
) -> None:
    """With an arrival-rate estimate, a wait ends by the timeout and waking then admits."""
    ctl = AdmissionController(config)
    now = 0.0
    ctl.observe_arrival(now)
    for gap in gaps:
        now += gap
        ctl.observe_arrival(now)
    decision = ctl.decide(now, depth, now)
    if decision.count == 0:
        assert decision.wake_at is not None
        assert now < decision.wake_at <= now + config.max_wait_s
        assert ctl.decide(decision.wake_at, depth, now).count == depth


@settings(max_examples=200, deadline=None)
@given(configs, st.lists(st.floats(0.0, 2.0), min_size=1, max_size=30), st.integers(0, 64))
@example(  # found by Hypothesis: float sums left the fill deadline an ulp after `now`
    AdmissionConfig(
        policy="aimd",
        n_max=9,
        alpha=0.2313954668058945,
        beta=0.42428415209262205,
        ttft_low_s=0.8487736206370577,
        ttft_high_s=2.0,
        ttft_ewma_weight=0.9179176799611246,
        ttft_window=62,
        burst_queue_depth=79,
        burst_arrival_rate=50.0,
        arrival_ewma_weight=0.1,
        max_wait_s=0.5630571976967725,
    ),
    [2.2250738585e-313, 5e-324, 0.864299982107527, 1.69510566051374, 0.27804315088544135,
     1.8205674226303916, 0.3930401408470595],
    7,
)  # fmt: skip
def test_sparse_arrivals_are_admitted_at_once(
    config: AdmissionConfig, extra_gaps: list[float], slack_updates: int
) -> None:
    """At low load (arrivals at least max_wait_s apart) aimd admits like immediate, even with
    N_t grown by slack: no group can fill before the timeout, so nobody waits for one."""
    config = replace(config, n_min=1)
    ctl = AdmissionController(config)
    for _ in range(slack_updates):
        ctl.observe_ttfts([0.0])
    now = 0.0
    ctl.observe_arrival(now)
    for extra in extra_gaps:
        now += config.max_wait_s + extra
        ctl.observe_arrival(now)
        assert ctl.decide(now, 1, now).count == 1
