"""packing.SortedSequences: a partition's sequences sorted and compared once; every subset's
radix tree (the planner's buckets and shards) derived from it equals the one built afresh."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from packing import (
    SortedSequences,
    group_prefixes,
    one_level_optimal_saving_ratio,
    optimal_saving_ratio,
    prefix_forest,
)
from tests.packing.test_prefix import sharing_seqs


@st.composite
def seqs_and_subset(draw: st.DrawFn) -> tuple[list[list[int]], list[int]]:
    """Sequences (duplicates among them) and distinct indices into them in any order."""
    seqs = draw(sharing_seqs())
    rows = draw(st.permutations(range(len(seqs))))
    return seqs, rows[: draw(st.integers(0, len(seqs)))]


@settings(max_examples=300, deadline=None)
@given(seqs_and_subset())
def test_a_subset_sorts_and_compares_as_its_own_sequences(
    case: tuple[list[list[int]], list[int]],
) -> None:
    seqs, rows = case
    derived = SortedSequences.of(seqs).subset(rows)
    fresh = SortedSequences.of([seqs[r] for r in rows])
    assert derived.lengths.tolist() == fresh.lengths.tolist()
    assert derived.order.tolist() == fresh.order.tolist()  # equal ones by subset index too
    assert derived.lcp.tolist() == fresh.lcp.tolist()


@settings(max_examples=300, deadline=None)
@given(seqs_and_subset(), st.integers(1, 4))
def test_groups_from_a_subset_equal_groups_built_afresh(
    case: tuple[list[list[int]], list[int]], min_shared: int
) -> None:
    seqs, rows = case
    subset = SortedSequences.of(seqs).subset(rows)
    own = [seqs[r] for r in rows]
    assert group_prefixes(subset, min_shared) == group_prefixes(own, min_shared)
    assert prefix_forest(subset, min_shared) == prefix_forest(own, min_shared)
    assert optimal_saving_ratio(subset) == optimal_saving_ratio(own)
    assert one_level_optimal_saving_ratio(subset) == one_level_optimal_saving_ratio(own)


def test_sorted_once_takes_the_place_of_the_sequences() -> None:
    seqs = [[5, 1, 2, 3], [5, 1, 2, 4], [5, 1, 9], [7], [5, 1, 2, 3]]
    arrays = [np.asarray(s, dtype=np.int32) for s in seqs]
    index = SortedSequences.of(arrays)
    assert index.num_seqs == 5 and index.num_tokens == 16
    assert index.order.tolist() == [0, 4, 1, 2, 3]
    assert index.lcp.tolist() == [4, 3, 2, 0]
    assert group_prefixes(index) == group_prefixes(seqs)
    assert prefix_forest(index) == prefix_forest(seqs)
    assert optimal_saving_ratio(index) == optimal_saving_ratio(seqs) == 9 / 16
    empty = index.subset([])
    assert empty.num_seqs == 0 and group_prefixes(empty) == [] and prefix_forest(empty) == []
