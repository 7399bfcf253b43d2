"""Saving ratios: achieved (Eq. 2), the best one-level grouping, and every prefix once."""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packing.prefix import (
    PrefixGroup,
    group_prefixes,
    one_level_optimal_saving_ratio,
    optimal_saving_ratio,
    saving_ratio,
)


@st.composite
def sharing_seqs(draw: st.DrawFn, max_seqs: int = 7) -> list[list[int]]:
    """A few sequences made of shared stems, so that prefixes are shared at several depths."""
    stems = draw(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5), min_size=1))
    seqs = []
    for _ in range(draw(st.integers(0, max_seqs))):
        parts = draw(st.lists(st.sampled_from(stems), max_size=3))
        seqs.append([t for part in parts for t in part])
    return seqs


def common_prefix(seqs: list[list[int]], rows: list[int]) -> int:
    n = 0
    while all(len(seqs[r]) > n and seqs[r][n] == seqs[rows[0]][n] for r in rows):
        n += 1
    return n


def partitions(items: list[int]) -> Iterator[list[list[int]]]:
    """Every set partition of `items`."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for smaller in partitions(rest):
        yield [[first], *smaller]
        for i in range(len(smaller)):
            yield [*smaller[:i], [first, *smaller[i]], *smaller[i + 1 :]]


@settings(max_examples=150, deadline=None)
@given(sharing_seqs())
def test_one_level_optimum_is_the_best_partition(seqs: list[list[int]]) -> None:
    total = sum(len(s) for s in seqs)
    best = max(
        sum((len(g) - 1) * common_prefix(seqs, g) for g in p)
        for p in partitions(list(range(len(seqs))))
    )
    expected = best / total if total else 0.0
    assert one_level_optimal_saving_ratio(seqs) == pytest.approx(expected)


@settings(max_examples=200, deadline=None)
@given(sharing_seqs(max_seqs=12))
def test_achieved_within_one_level_optimum_within_optimum(seqs: list[list[int]]) -> None:
    achieved = saving_ratio(seqs, group_prefixes(seqs))
    assert 0.0 <= achieved <= one_level_optimal_saving_ratio(seqs) + 1e-12
    assert one_level_optimal_saving_ratio(seqs) <= optimal_saving_ratio(seqs) + 1e-12


@settings(max_examples=200, deadline=None)
@given(sharing_seqs(max_seqs=12))
def test_optimal_saving_ratio_counts_distinct_prefixes(seqs: list[list[int]]) -> None:
    total = sum(len(s) for s in seqs)
    distinct = {tuple(s[:k]) for s in seqs for k in range(1, len(s) + 1)}
    expected = 1 - len(distinct) / total if total else 0.0
    assert optimal_saving_ratio(seqs) == pytest.approx(expected)


def test_conversations_share_at_many_levels() -> None:
    # Two pairs of prompts that share an opening; one level cannot share both the opening
    # and each pair's conversation, every-prefix-once can.
    opening = [1] * 10
    a, b = opening + [2] * 20, opening + [3] * 20
    seqs = [a + [4], a + [5], b + [4], b + [5]]
    assert optimal_saving_ratio(seqs) == pytest.approx(1 - (10 + 2 * 20 + 4) / 124)
    assert one_level_optimal_saving_ratio(seqs) == pytest.approx(2 * 30 / 124)
    assert saving_ratio(seqs, group_prefixes(seqs)) == pytest.approx(2 * 30 / 124)


def test_saving_ratio_example_and_pickled_groups() -> None:
    seqs = [[1, 2, 3], [1, 2, 4], [5]]
    groups = [PrefixGroup(2, (0, 1)), PrefixGroup(0, (2,))]
    assert saving_ratio(seqs, groups) == pytest.approx(1 - (2 + 1 + 1 + 1) / 7)
    assert pickle.loads(pickle.dumps(groups)) == groups  # groups travel between Ray workers


def test_saving_ratio_rejects_groups_that_do_not_partition() -> None:
    seqs = [[1, 2], [1, 3], [4]]
    with pytest.raises(ValueError, match="row 1 is in two groups"):
        saving_ratio(seqs, [PrefixGroup(1, (0, 1)), PrefixGroup(0, (1,))])
    with pytest.raises(ValueError, match="row 3 is out of range"):
        saving_ratio(seqs, [PrefixGroup(1, (0, 1)), PrefixGroup(0, (3,))])
    # A row in no group is computed whole (prefix_forest leaves unshared rows out).
    assert saving_ratio(seqs, [PrefixGroup(1, (0, 1))]) == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match="row 2 has 1 tokens, fewer than its group's prefix_len 2"):
        saving_ratio(seqs, [PrefixGroup(1, (0, 1)), PrefixGroup(2, (2,))])
    with pytest.raises(ValueError, match="seqs must be a list of token sequences"):
        saving_ratio("abc", [])  # type: ignore[arg-type]
    assert saving_ratio([[], []], [PrefixGroup(0, (0, 1))]) == 0.0
    assert optimal_saving_ratio([]) == one_level_optimal_saving_ratio([]) == 0.0
