"""packing.bins: every method against slow, obviously-correct references."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packing.bins import METHODS, pack


@st.composite
def instances(draw: st.DrawFn, max_items: int = 40) -> tuple[list[int], int]:
    capacity = draw(st.integers(1, 60))
    lengths = draw(st.lists(st.integers(1, capacity), max_size=max_items))
    return lengths, capacity


def check_valid(bins: list[list[int]], lengths: list[int], capacity: int) -> None:
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(b and b == sorted(b) for b in bins)
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    assert len(bins) >= -(-sum(lengths) // capacity)


def decreasing(lengths: list[int]) -> list[int]:
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def naive_first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    for i in decreasing(lengths):
        for b in bins:
            if sum(lengths[j] for j in b) + lengths[i] <= capacity:
                b.append(i)
                break
        else:
            bins.append([i])
    return [sorted(b) for b in bins]


def naive_best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    for i in decreasing(lengths):
        rooms = [(capacity - sum(lengths[j] for j in b), k) for k, b in enumerate(bins)]
        fitting = [(room, k) for room, k in rooms if room >= lengths[i]]
        if fitting:
            bins[min(fitting)[1]].append(i)
        else:
            bins.append([i])
    return [sorted(b) for b in bins]


def naive_balanced(lengths: list[int], capacity: int) -> list[list[int]]:
    groups: list[list[int]] = [[] for _ in range(-(-sum(lengths) // capacity))]
    for i in decreasing(lengths):
        loads = [(sum(lengths[j] for j in g), k) for k, g in enumerate(groups)]
        load, k = min(loads)
        if load + lengths[i] <= capacity:
            groups[k].append(i)
        else:
            groups.append([i])
    return [sorted(g) for g in groups if g]


def naive_length_ordered(lengths: list[int], capacity: int, batch: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    bins = []
    for start in range(0, len(order), batch):
        current: list[int] = []
        for i in order[start : start + batch]:
            if sum(lengths[j] for j in current) + lengths[i] > capacity:
                bins.append(sorted(current))
                current = []
            current.append(i)
        bins.append(sorted(current))
    return bins


def brute_force_min_bins(lengths: list[int], capacity: int) -> int:
    """Every set partition of the items (small inputs only)."""
    best = len(lengths)

    def place(i: int, loads: list[int]) -> None:
        nonlocal best
        if len(loads) >= best:
            return
        if i == len(lengths):
            best = len(loads)
            return
        for k in range(len(loads)):
            if loads[k] + lengths[i] <= capacity:
                loads[k] += lengths[i]
                place(i + 1, loads)
                loads[k] -= lengths[i]
        place(i + 1, [*loads, lengths[i]])

    place(0, [])
    return best


@settings(max_examples=300, deadline=None)
@given(instances())
def test_greedy_methods_equal_their_naive_definitions(case: tuple[list[int], int]) -> None:
    lengths, capacity = case
    for method, reference in [
        ("ffd", naive_first_fit),
        ("bfd", naive_best_fit),
        ("balanced", naive_balanced),
    ]:
        bins = pack(lengths, capacity, method)
        check_valid(bins, lengths, capacity)
        assert bins == reference(lengths, capacity), method


@settings(max_examples=200, deadline=None)
@given(instances(), st.integers(1, 8))
def test_length_ordered_chunks_and_respects_capacity(
    case: tuple[list[int], int], batch: int
) -> None:
    lengths, capacity = case
    bins = pack(lengths, capacity, "length_ordered", batch_size=batch)
    check_valid(bins, lengths, capacity)
    assert all(len(b) <= batch for b in bins)
    assert bins == naive_length_ordered(lengths, capacity, batch)


@settings(max_examples=300, deadline=None)
@given(instances(max_items=8))
def test_optimal_is_the_brute_force_minimum_and_ffd_within_its_bound(
    case: tuple[list[int], int],
) -> None:
    lengths, capacity = case
    opt = brute_force_min_bins(lengths, capacity)
    bins = pack(lengths, capacity, "optimal")
    check_valid(bins, lengths, capacity)
    assert len(bins) == opt
    assert 9 * len(pack(lengths, capacity, "ffd")) <= 11 * opt + 6  # Dosa's tight FFD bound


@settings(max_examples=200, deadline=None)
@given(instances(max_items=40))
def test_every_method_is_valid_and_deterministic(case: tuple[list[int], int]) -> None:
    lengths, capacity = case
    for method in METHODS:
        batch = 4 if method == "length_ordered" else None
        if method == "optimal" and len(lengths) > 20:
            continue  # covered in test_optimal.py; keeps this test fast
        bins = pack(lengths, capacity, method, batch_size=batch)
        check_valid(bins, lengths, capacity)
        assert pack(list(lengths), capacity, method, batch_size=batch) == bins
        assert pack(np.asarray(lengths, dtype=np.int64), capacity, method, batch_size=batch) == bins


def test_ffd_on_many_items_is_valid() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2049, 100_000)
    bins = pack(lengths, 4096)
    check_valid(bins, lengths.tolist(), 4096)
    assert len(bins) <= 1.01 * lengths.sum() / 4096 + 1


def test_examples() -> None:
    assert pack([5, 4, 3, 2, 1], 6) == [[0, 4], [1, 3], [2]]
    assert pack([5, 4, 3, 2, 1], 6, "bfd") == [[0, 4], [1, 3], [2]]
    assert pack([3, 3, 2, 2, 2], 6, "balanced") == [[0, 2], [1, 3], [4]]
    assert pack([4, 4, 3, 3, 2, 2], 9, "ffd") == [[0, 1], [2, 3, 4], [5]]
    assert pack([4, 4, 3, 3, 2, 2], 9, "optimal") == [[0, 2, 4], [1, 3, 5]]
    assert pack([5, 1, 4, 2], 6, "length_ordered", batch_size=2) == [[1, 3], [2], [0]]
    assert pack([], 10) == []


@pytest.mark.parametrize(
    ("lengths", "capacity", "method", "batch", "message"),
    [
        ([3, 0], 5, "ffd", None, r"lengths\[1\] must be an integer >= 1, got 0"),
        ([3, -2], 5, "ffd", None, r"lengths\[1\] must be an integer >= 1, got -2"),
        ([3, 2.5], 5, "ffd", None, r"lengths\[1\] must be an integer >= 1, got 2.5 \(float\)"),
        ([True], 5, "ffd", None, r"lengths\[0\] must be an integer >= 1, got True"),
        ("abc", 5, "ffd", None, "lengths must be a sequence of integers, got 'abc'"),
        (np.array([1.0]), 5, "ffd", None, "lengths must be a 1-D integer array"),
        (np.array([2, 0]), 5, "ffd", None, r"lengths\[1\] must be >= 1, got 0"),
        ([3], 0, "ffd", None, "capacity must be a positive integer, got 0"),
        ([3], 5.0, "ffd", None, r"capacity must be a positive integer, got 5.0 \(float\)"),
        ([3, 9], 5, "ffd", None, "item 1 has length 9, more than the capacity 5"),
        ([3], 5, "worst_fit", None, "method must be one of .*; got 'worst_fit'"),
        ([3], 5, "length_ordered", None, 'method "length_ordered" needs batch_size'),
        ([3], 5, "length_ordered", 0, "batch_size must be a positive integer, got 0"),
        ([3], 5, "ffd", 4, 'batch_size only applies to method "length_ordered", not "ffd"'),
        ([1] * 65, 5, "optimal", None, 'exact for at most 64 items, got 65; use "ffd"'),
    ],
)
def test_bad_input_is_a_value_error(
    lengths: object, capacity: object, method: str, batch: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        pack(lengths, capacity, method, batch_size=batch)  # type: ignore[arg-type]
