"""packing.optimal: the exact solver against a subset DP, its bounds and its search limit."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import packing.optimal
from packing.bins import pack
from packing.optimal import lower_bound_l1, lower_bound_l2


def min_bins_by_subset_dp(lengths: list[int], capacity: int) -> int:
    """Fewest bins by DP over subsets: best[mask] = (bins, load of the last bin), minimised.

    Adding items one at a time to the last open bin, or opening a new one, reaches every
    packing in some order, so the minimum over all orders is the optimum.
    """
    n = len(lengths)
    best = [(n + 1, 0)] * (1 << n)
    best[0] = (0, capacity)  # a "full" last bin forces the first item to open one
    for mask in range(1 << n):
        bins, load = best[mask]
        for i in range(n):
            if not mask >> i & 1:
                step = (bins, load + lengths[i])
                if load + lengths[i] > capacity:
                    step = (bins + 1, lengths[i])
                nxt = mask | 1 << i
                best[nxt] = min(best[nxt], step)
    return best[-1][0]


@st.composite
def hard_instances(draw: st.DrawFn) -> tuple[list[int], int]:
    """Items between a fifth and a half of the capacity: few per bin, many near fits."""
    capacity = draw(st.integers(10, 100))
    size = st.integers(max(1, capacity // 5), capacity // 2)
    return draw(st.lists(size, min_size=1, max_size=11)), capacity


@settings(max_examples=60, deadline=None)
@given(hard_instances())
def test_optimal_equals_subset_dp(case: tuple[list[int], int]) -> None:
    lengths, capacity = case
    opt = min_bins_by_subset_dp(lengths, capacity)
    bins = pack(lengths, capacity, "optimal")
    assert len(bins) == opt
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    assert lower_bound_l1(lengths, capacity) <= lower_bound_l2(lengths, capacity) <= opt


def test_l2_beats_l1_on_large_items() -> None:
    # Three items over half the capacity need three bins although they total < 2 bins.
    assert lower_bound_l1([6, 6, 6], 10) == 2
    assert lower_bound_l2([6, 6, 6], 10) == 3


def test_64_realistic_items_are_solved_and_beat_or_match_ffd() -> None:
    rng = random.Random(7)
    for _ in range(10):
        capacity = 4096
        lengths = [min(capacity, int(rng.lognormvariate(6, 0.9)) + 1) for _ in range(64)]
        bins = pack(lengths, capacity, "optimal")
        assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
        assert lower_bound_l2(lengths, capacity) <= len(bins) <= len(pack(lengths, capacity))


def test_gives_up_with_a_value_error_when_the_search_is_too_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # FFD needs 3 bins here, 2 suffice, so the search must run; a tiny limit stops it.
    lengths = [4, 4, 3, 3, 2, 2]
    assert len(pack(lengths, 9, "ffd")) == 3
    monkeypatch.setattr(packing.optimal, "MAX_SEARCH_STEPS", 2)
    with pytest.raises(ValueError, match='gave up after 2 search steps on 6 items.*use "ffd"'):
        pack(lengths, 9, "optimal")
