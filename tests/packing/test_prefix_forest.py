"""packing.prefix_forest against a brute-force reference over all prefixes, and saving_ratio
on nested groups."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packing.prefix import (
    PrefixGroup,
    optimal_saving_ratio,
    prefix_forest,
    saving_ratio,
)

# Few distinct tokens and short lengths, so sequences share at several depths.
sequences = st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=7), min_size=0, max_size=12)


def reference_forest(seqs: list[list[int]], min_shared: int) -> set[tuple[int, tuple[int, ...]]]:
    """Every branching node of the trie over the sequences without their last token.

    A prefix p of length >= min_shared is a group when >= 2 sequences extend past it (they
    share p and p is shorter than each) and no one-token extension of p keeps them all.
    """

    def below(p: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(seqs) if len(s) > len(p) and tuple(s[: len(p)]) == p)

    prefixes = {tuple(s[:k]) for s in seqs for k in range(min_shared, len(s))}
    groups = set()
    for p in prefixes:
        members = below(p)
        if len(members) < 2:
            continue
        extensions = {tuple(seqs[i][: len(p) + 1]) for i in members}
        if len(extensions) == 1 and below(next(iter(extensions))) == members:
            continue  # not a node: the edge goes on
        groups.add((len(p), members))
    return groups


def capped_processed(seqs: list[list[int]]) -> int:
    """Fewest prefill tokens when every sequence computes its own last token: each distinct
    proper prefix once, plus one token per non-empty sequence."""
    proper = {tuple(s[:k]) for s in seqs for k in range(1, len(s))}
    return len(proper) + sum(1 for s in seqs if s)


@settings(max_examples=300, deadline=None)
@given(seqs=sequences, min_shared=st.integers(1, 3), as_arrays=st.booleans())
def test_forest_matches_reference_and_nests(seqs, min_shared, as_arrays) -> None:
    given_seqs = [np.asarray(s, dtype=np.int32) for s in seqs] if as_arrays else seqs
    forest = prefix_forest(given_seqs, min_shared)
    assert {(g.prefix_len, g.members) for g in forest} == reference_forest(seqs, min_shared)
    assert len({(g.prefix_len, g.members) for g in forest}) == len(forest)  # no duplicates
    for index, g in enumerate(forest):
        assert list(g.members) == sorted(set(g.members)) and len(g.members) >= 2
        assert g.prefix_len >= min_shared
        for m in g.members:  # members truly share the prefix, and it is not all of them
            assert seqs[m][: g.prefix_len] == seqs[g.members[0]][: g.prefix_len]
            assert len(seqs[m]) > g.prefix_len
        # The parent is the nearest enclosing group, earlier in the list.
        enclosing = [
            j
            for j, h in enumerate(forest)
            if h.prefix_len < g.prefix_len and set(g.members) <= set(h.members)
        ]
        if g.parent is None:
            assert not enclosing
        else:
            parent = forest[g.parent]
            assert g.parent < index
            assert set(g.members) <= set(parent.members)
            assert g.prefix_len > parent.prefix_len
            assert g.parent == max(enclosing, key=lambda j: forest[j].prefix_len)
    # Groups holding one row form one chain (a row's groups are nested, never siblings).
    for row in range(len(seqs)):
        chain = [j for j, g in enumerate(forest) if row in g.members]
        for outer, inner in zip(chain, chain[1:], strict=False):
            assert forest[inner].parent == outer


@settings(max_examples=300, deadline=None)
@given(seqs=sequences)
def test_forest_saving_is_the_optimum_up_to_the_last_token(seqs) -> None:
    """What is compared: with min_shared=1 the forest's processed tokens equal the fewest
    possible when each sequence computes its own last token (capped_processed, brute force),
    and differ from the optimum's (every distinct prefix once) by exactly the sequences that
    equal or are a prefix of another one (their last token is computed again)."""
    total = sum(len(s) for s in seqs)
    forest = prefix_forest(seqs)
    achieved = saving_ratio(seqs, forest)
    if total == 0:
        assert achieved == 0.0
        return
    assert achieved == pytest.approx(1 - capped_processed(seqs) / total, abs=1e-12)
    distinct = {tuple(s) for s in seqs if s}
    leaves = [
        s for s in distinct if not any(len(t) > len(s) and t[: len(s)] == s for t in distinct)
    ]
    recomputed = sum(1 for s in seqs if s) - len(leaves)
    assert optimal_saving_ratio(seqs) - achieved == pytest.approx(recomputed / total, abs=1e-12)
    if recomputed == 0:
        assert achieved == pytest.approx(optimal_saving_ratio(seqs), abs=1e-12)


def test_forest_example_conversations() -> None:
    # Two conversations sharing an opening; each has two continuations; a lone prompt.
    opening, turn_a, turn_b = [1, 2, 3], [4, 5], [6, 7, 8]
    seqs = [
        opening + turn_a + [9],
        opening + turn_b + [10],
        opening + turn_a + [11, 12],
        [13, 14],
        opening + turn_b + [15],
    ]
    forest = prefix_forest(seqs)
    assert forest == [
        PrefixGroup(3, (0, 1, 2, 4)),
        PrefixGroup(5, (0, 2), parent=0),
        PrefixGroup(6, (1, 4), parent=0),
    ]
    # processed: 3 + 2 + 3 (prefixes) + 1 + 1 + 2 + 2 + 1 (suffixes)
    assert saving_ratio(seqs, forest) == pytest.approx(1 - 15 / 29)
    assert saving_ratio(seqs, forest) == pytest.approx(optimal_saving_ratio(seqs))
    assert prefix_forest(seqs, min_shared=4) == [PrefixGroup(5, (0, 2)), PrefixGroup(6, (1, 4))]


def test_forest_caps_at_the_last_token_and_edge_cases() -> None:
    # [1, 2] is a prefix of the others: it shares [1] and computes its last token itself.
    assert prefix_forest([[1, 2], [1, 2, 3], [1, 2, 4]]) == [
        PrefixGroup(1, (0, 1, 2)),
        PrefixGroup(2, (1, 2), parent=0),
    ]
    assert prefix_forest([[5, 6], [5, 6]]) == [PrefixGroup(1, (0, 1))]  # duplicates
    assert prefix_forest([]) == [] and prefix_forest([[1, 2]]) == []
    assert prefix_forest([[1], [1], []]) == []  # a one-token prompt shares nothing
    with pytest.raises(ValueError, match="min_shared"):
        prefix_forest([[1]], min_shared=0)


def test_saving_ratio_nested_checks() -> None:
    seqs = [[1, 2, 3], [1, 2, 4], [1, 5], [6]]
    nested = [PrefixGroup(1, (0, 1, 2)), PrefixGroup(2, (0, 1), parent=0)]
    assert saving_ratio(seqs, nested) == pytest.approx(1 - (1 + 1 + 1 + 1 + 1 + 1) / 9)
    with pytest.raises(ValueError, match="group 1: parent 1 must be an earlier group"):
        saving_ratio(seqs, [nested[0], PrefixGroup(2, (0, 1), parent=1)])
    with pytest.raises(ValueError, match="group 1: prefix_len 1 must exceed its parent's"):
        saving_ratio(seqs, [nested[0], PrefixGroup(1, (0, 1), parent=0)])
    with pytest.raises(ValueError, match="group 1: row 3 is not a member of its parent group 0"):
        saving_ratio(seqs, [nested[0], PrefixGroup(2, (0, 3), parent=0)])
    with pytest.raises(ValueError, match="group 2: row 1 is in two groups"):
        saving_ratio(seqs, [*nested, PrefixGroup(2, (1,), parent=0)])
    with pytest.raises(ValueError, match="parent must be None or a group index"):
        PrefixGroup(1, (0, 1), parent=-1)
