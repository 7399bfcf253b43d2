"""The step budget's TPOT controller: its rule, fed step times (no engine, no clock)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packing.step_budget import StepBudgetConfig, StepBudgetController

TARGET = 0.1


def controller(**overrides: object) -> StepBudgetController:
    kwargs: dict[str, object] = dict(
        tpot_target_s=TARGET, ceiling=512, increase_tokens=16, decrease_factor=0.5
    )
    kwargs.update(overrides)
    return StepBudgetController(StepBudgetConfig(**kwargs))  # type: ignore[arg-type]


def test_starts_at_the_ceiling_or_the_initial_budget() -> None:
    assert controller().current == 512
    assert controller(initial=64).current == 64
    assert controller(initial=64).budget(num_decodes=0) == 64


def test_a_slow_step_cuts_the_budget_it_ran_with() -> None:
    ctl = controller()
    assert ctl.observe(0.2, budget_used=512, tokens_scheduled=512, num_decodes=10) == 256
    assert ctl.observe(0.2, budget_used=256, tokens_scheduled=100, num_decodes=10) == 128
    assert ctl.num_decreases == 2 and ctl.num_increases == 0


def test_a_fast_full_step_grows_the_budget_additively() -> None:
    ctl = controller(initial=100)
    for expected in (116, 132, 148):
        assert ctl.observe(0.05, ctl.budget(4), ctl.budget(4), num_decodes=4) == expected
    assert ctl.num_increases == 3


def test_a_fast_step_with_room_left_keeps_the_budget() -> None:
    """Unused budget says nothing about a larger one: no growth while the engine idles."""
    ctl = controller(initial=100)
    for _ in range(50):
        assert ctl.observe(0.01, budget_used=100, tokens_scheduled=30, num_decodes=30) == 100
    assert ctl.num_increases == 0


def test_exactly_on_target_counts_as_within() -> None:
    ctl = controller(initial=100)
    assert ctl.observe(TARGET, 100, 100, num_decodes=0) == 116


def test_growth_stops_at_the_ceiling() -> None:
    ctl = controller(initial=500)
    assert ctl.observe(0.01, 500, 500, 0) == 512
    assert ctl.observe(0.01, 512, 512, 0) == 512
    assert ctl.num_increases == 1


def test_the_floor_fits_every_decode_and_a_prefill_chunk() -> None:
    ctl = controller(initial=32, min_prefill_tokens=16)
    assert ctl.floor(100) == 116
    assert ctl.budget(num_decodes=100) == 116  # B (32) raised to the floor
    assert ctl.budget(num_decodes=3) == 32
    # a cut never goes below the floor of the step that was slow
    assert ctl.observe(1.0, budget_used=116, tokens_scheduled=116, num_decodes=100) == 116
    # the floor is capped by the ceiling (more decodes than the ceiling: the ceiling rules)
    assert ctl.floor(600) == 512 and ctl.budget(600) == 512


def test_growth_starts_from_the_floor_when_the_floor_ran_the_step() -> None:
    ctl = controller(initial=32)
    used = ctl.budget(num_decodes=100)  # 116
    assert ctl.observe(0.01, used, used, num_decodes=100) == 132


def test_sawtooth_around_the_budget_the_target_allows() -> None:
    """A step costing 20 ms + 0.2 ms per token meets 100 ms up to 400 tokens: the budget
    climbs there, is cut when it passes, climbs again, and stays within [200, 416]."""
    ctl = controller(ceiling=1024, initial=64)
    seen = []
    for _ in range(400):
        used = ctl.budget(num_decodes=8)
        ctl.observe(0.02 + 0.0002 * used, used, used, num_decodes=8)
        seen.append(used)
    late = seen[100:]
    assert max(late) == 416 and min(late) >= 208
    assert ctl.num_decreases >= 5


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.floats(0.0, 1.0), st.integers(0, 700), st.integers(0, 2000), st.booleans()),
        max_size=60,
    ),
    ceiling=st.integers(1, 1024),
    factor=st.floats(0.05, 0.95),
)
def test_the_budget_stays_between_floor_and_ceiling(
    steps: list[tuple[float, int, int, bool]], ceiling: int, factor: float
) -> None:
    ctl = controller(ceiling=ceiling, decrease_factor=factor)
    for step_s, decodes, wanted, full in steps:
        used = ctl.budget(decodes)
        assert ctl.floor(decodes) <= used <= ceiling
        scheduled = used if full else min(used - 1, wanted)
        before = ctl.current
        after = ctl.observe(step_s, used, scheduled, decodes)
        assert 1 <= after <= ceiling
        if step_s > TARGET:
            assert after <= max(before, used) and after >= ctl.floor(decodes)
        else:
            assert after >= before


@pytest.mark.parametrize(
    "bad",
    [
        dict(tpot_target_s=0),
        dict(tpot_target_s=float("nan")),
        dict(ceiling=0),
        dict(increase_tokens=0),
        dict(decrease_factor=1.0),
        dict(decrease_factor=0.0),
        dict(min_prefill_tokens=0),
        dict(initial=1000),
    ],
)
def test_bad_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        controller(**bad)
