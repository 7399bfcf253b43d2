"""The modelled engine behind the admission rule (noise-free policy comparison)."""

from __future__ import annotations

import pytest

from benchmarks.replay import TraceRequest
from benchmarks.simulate import StepCost, simulate
from packing.admission import AdmissionConfig

COST = StepCost(fixed_s=0.05, per_token_s=0.001, per_request_s=0.0)


def request(at: float, prompt: int, out: int) -> TraceRequest:
    return TraceRequest(at, tuple(range(prompt)), out, "p")


def test_lone_request_timing_follows_the_step_cost() -> None:
    [result] = simulate([request(1.0, 100, 3)], AdmissionConfig("immediate"), COST)
    assert result.ttft_s == pytest.approx(0.05 + 0.1)  # one prefill step
    assert result.latency_s == pytest.approx(0.15 + 2 * 0.051)  # then two decode steps


def test_chunked_prefill_and_windows_delay_first_tokens() -> None:
    reqs = [request(0.0, 600, 1)]  # over the 512-token budget: two prefill steps
    [result] = simulate(reqs, AdmissionConfig("immediate"), COST)
    assert result.ttft_s == pytest.approx(0.05 + 0.512 + 0.05 + 0.088)
    [held] = simulate(reqs, AdmissionConfig("fixed", window_requests=4, window_s=0.2), COST)
    assert held.ttft_s == pytest.approx(result.ttft_s + 0.2)


def test_every_policy_answers_everything_and_immediate_is_never_slower() -> None:
    reqs = [request(0.1 * i, 20 + 7 * (i % 5), 1 + i % 4) for i in range(60)]
    policies = [
        AdmissionConfig("immediate"),
        AdmissionConfig("fixed", window_requests=4, window_s=0.1),
        AdmissionConfig("aimd", ttft_low_s=1.0, ttft_high_s=2.0, max_wait_s=0.1),
    ]
    results = [simulate(reqs, policy, COST) for policy in policies]
    assert all(len(r) == 60 and all(x.ttft_s is not None for x in r) for r in results)
    immediate = sorted(x.ttft_s or 0.0 for x in results[0])
    for other in results[1:]:
        assert sum(immediate) <= sum(x.ttft_s or 0.0 for x in other) + 1e-9


def test_step_budget_controller_splits_a_prompt_into_smaller_steps() -> None:
    """The modelled engine runs the same controller: after each step over the target the
    budget is cut (x 0.75), so a long prompt's prefill takes more, smaller steps."""
    from packing.step_budget import StepBudgetConfig

    reqs = [request(0.0, 600, 1)]
    [fixed] = simulate(reqs, AdmissionConfig("immediate"), COST)
    aimed = StepBudgetConfig(tpot_target_s=0.2, ceiling=512)
    [controlled] = simulate(reqs, AdmissionConfig("immediate"), COST, step_budget=aimed)
    assert controlled.ttft_s == pytest.approx(fixed.ttft_s)
    strict = StepBudgetConfig(tpot_target_s=0.01, ceiling=512)
    [floored] = simulate(reqs, AdmissionConfig("immediate"), COST, step_budget=strict)
    # 512, then 384 (88 left): the same two steps' tokens, so the same TTFT
    assert floored.ttft_s == pytest.approx(fixed.ttft_s)
    [long] = simulate(
        [request(0.0, 1500, 1)], AdmissionConfig("immediate"), COST, step_budget=strict
    )
    # 512, 384, 288, 216, 100 (the rest): five steps against three with a fixed 512
    assert long.ttft_s == pytest.approx(5 * 0.05 + 1.5)
