"""packing.prefix against an explicit token-by-token trie that applies Algorithm 1 literally."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packing.prefix import PrefixGroup, group_prefixes, optimal_saving_ratio, saving_ratio


class TrieNode:
    """One token of the reference trie (and, once compressed, one radix tree node)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.kids: dict[int, TrieNode] = {}
        self.ends: list[int] = []  # rows whose sequence ends here
        self.children: list[TrieNode] = []  # radix tree children, filled by compress()


def compress(node: TrieNode) -> TrieNode:
    """Radix tree: a node is kept when it is the root, ends a sequence or branches."""
    for kid in node.kids.values():
        while len(kid.kids) == 1 and not kid.ends:
            (kid,) = kid.kids.values()
        node.children.append(compress(kid))
    return node


def rows_under(node: TrieNode) -> list[int]:
    return node.ends + [r for kid in node.children for r in rows_under(kid)]


def maximize_reuse(v: TrieNode) -> None:
    """Algorithm 1, literally: children first, then fork-and-merge grandchildren into v."""
    for u in v.children:
        maximize_reuse(u)
    todo, kept = list(v.children), []
    while todo:
        u = todo.pop()
        stay = []
        for w in u.children:
            if (len(rows_under(w)) - 1) * (w.depth - u.depth) > u.depth - v.depth:
                todo.append(w)  # forked off u, merged into v: examined as v's child
            else:
                stay.append(w)
        u.children = stay
        if not u.ends and len(stay) <= 1:
            todo += stay  # u is empty now: its only child (if any) takes its place
        else:
            kept.append(u)
    v.children = kept


def reference_groups(seqs: list[list[int]], min_shared: int) -> set[tuple[int, tuple[int, ...]]]:
    """BatchLLM's grouping on a dict trie built token by token, compressed to a radix tree.

    The first-level nodes (the shallowest at depth >= min_shared) hang from a virtual root;
    after maximize_reuse its children are the groups.
    """
    root = TrieNode(0)
    for row, seq in enumerate(seqs):
        node = root
        for token in seq:
            node = node.kids.setdefault(token, TrieNode(node.depth + 1))
        node.ends.append(row)
    compress(root)
    virtual = TrieNode(0)
    todo = [root]
    while todo:
        node = todo.pop()
        if node.depth >= min_shared:
            virtual.children.append(node)
        else:
            todo += node.children
    maximize_reuse(virtual)
    groups = set()
    for head in virtual.children:
        rows = tuple(sorted(rows_under(head)))
        groups.add((common_prefix(seqs, rows) if len(rows) > 1 else 0, rows))
    grouped = {r for _, rows in groups for r in rows}
    return groups | {(0, (r,)) for r in range(len(seqs)) if r not in grouped}


def common_prefix(seqs: list[list[int]], rows: tuple[int, ...]) -> int:
    """Length of the longest common prefix of the given rows, token by token."""
    n = 0
    while all(len(seqs[r]) > n and seqs[r][n] == seqs[rows[0]][n] for r in rows):
        n += 1
    return n


# Sequences built from a few shared stems, so the trees have real depth and branching.
stems = st.lists(st.lists(st.integers(0, 3), max_size=6), min_size=1, max_size=4)


@st.composite
def sharing_seqs(draw: st.DrawFn) -> list[list[int]]:
    """Sequences that share prefixes in many ways: stems, duplicates, prefixes of others."""
    pool = draw(stems)
    seqs = []
    for _ in range(draw(st.integers(0, 12))):
        seq: list[int] = []
        for _ in range(draw(st.integers(0, 3))):
            seq += draw(st.sampled_from(pool))
        seqs.append(seq[: draw(st.integers(0, len(seq)))] if draw(st.booleans()) else seq)
    return seqs


@settings(max_examples=300, deadline=None)
@given(sharing_seqs(), st.integers(1, 4))
def test_matches_reference_trie(seqs: list[list[int]], min_shared: int) -> None:
    groups = group_prefixes(seqs, min_shared=min_shared)
    assert {(g.prefix_len, g.members) for g in groups} == reference_groups(seqs, min_shared)


@settings(max_examples=200, deadline=None)
@given(sharing_seqs(), st.integers(1, 4))
def test_partition_and_true_prefixes(seqs: list[list[int]], min_shared: int) -> None:
    groups = group_prefixes(seqs, min_shared=min_shared)
    rows = sorted(r for g in groups for r in g.members)
    assert rows == list(range(len(seqs)))
    for g in groups:
        assert list(g.members) == sorted(g.members)
        if g.share_degree == 1:
            assert g.prefix_len == 0
        else:
            assert g.prefix_len >= min_shared
            assert g.prefix_len == common_prefix(seqs, g.members)
    assert 0.0 <= saving_ratio(seqs, groups) <= optimal_saving_ratio(seqs) + 1e-12


@settings(max_examples=100, deadline=None)
@given(sharing_seqs())
def test_deterministic_and_array_input_equal(seqs: list[list[int]]) -> None:
    arrays = [np.asarray(s, dtype=np.int32) for s in seqs]
    assert group_prefixes(seqs) == group_prefixes(seqs) == group_prefixes(arrays)


def test_deep_prefix_shared_by_many_is_split_off() -> None:
    system = list(range(100, 110))  # 10 tokens every prompt shares
    doc_a, doc_b = list(range(200, 300)), list(range(300, 400))  # 100-token documents
    seqs = [system + doc_a + [q] for q in range(5)] + [system + doc_b + [q] for q in range(5)]
    seqs.append(system + [7, 7])
    groups = group_prefixes(seqs)
    # (5 - 1) * 100 > 10: each document becomes its own group; the stray prompt keeps the
    # system prompt's group to itself, and so shares nothing.
    assert [(g.prefix_len, g.members) for g in groups] == [
        (0, (10,)),
        (110, (0, 1, 2, 3, 4)),
        (110, (5, 6, 7, 8, 9)),
    ]
    assert saving_ratio(seqs, groups) == pytest.approx(1 - (2 * 110 + 10 + 12) / 1122)


def test_pairs_below_a_shallow_branch_are_found() -> None:
    # "Human: How" branches into two pairs of prompts that share 100 tokens each. The branch
    # node alone is not worth splitting off at the first level ((4 - 1) * 1 <= 3), but the
    # bottom-up pass lifts each pair to the top ((2 - 1) * 96 > 1, then 97 > 3).
    opening = [1, 2, 3]
    pair_a, pair_b = opening + [4] + list(range(10, 106)), opening + [4] + list(range(200, 296))
    seqs = [pair_a + [7], pair_a + [8], pair_b + [7], pair_b + [8], opening + [5, 6]]
    groups = group_prefixes(seqs)
    assert [(g.prefix_len, g.members) for g in groups] == [
        (100, (0, 1)),
        (100, (2, 3)),
        (0, (4,)),
    ]


def test_a_node_emptied_by_forks_gives_way_to_its_child() -> None:
    v = list(range(1, 11))  # 10 tokens
    u = v + [20] * 6  # 16
    x, y = u + [30] * 14, u + [40] * 5  # 30 and 21 tokens
    seqs = [x + [1], x + [2], y + [1], y + [2], v + [99]]
    # Under v, x leaves u ((2 - 1) * 14 > 6) but y stays ((2 - 1) * 5 <= 6); u then holds
    # only y, so y takes its place with 11 tokens below v and rises too: (2 - 1) * 11 > 10.
    # Had u stayed, it would not rise ((2 - 1) * 6 <= 10) and y's rows would share 10 tokens.
    groups = group_prefixes(seqs)
    assert [(g.prefix_len, g.members) for g in groups] == [
        (30, (0, 1)),
        (21, (2, 3)),
        (0, (4,)),
    ]


def test_shallow_split_not_worth_it_keeps_the_first_level() -> None:
    shared = list(range(100))
    seqs = [shared + [1, 2, 3], shared + [1, 2, 4], shared + [5], shared + [6]]
    # Splitting off [1, 2] saves (2 - 1) * 2 tokens but repeats 100: not done.
    groups = group_prefixes(seqs)
    assert [(g.prefix_len, g.members) for g in groups] == [(100, (0, 1, 2, 3))]


def test_min_shared_leaves_short_sharers_alone() -> None:
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 9]]
    assert [(g.prefix_len, g.members) for g in group_prefixes(seqs, min_shared=3)] == [
        (3, (0, 1)),
        (0, (2,)),
    ]
    assert [(g.prefix_len, g.members) for g in group_prefixes(seqs, min_shared=4)] == [
        (0, (0,)),
        (0, (1,)),
        (0, (2,)),
    ]


def test_groups_come_in_lexicographic_order_and_duplicates_group() -> None:
    seqs = [[5, 1], [2, 2, 2], [5, 1], [], [2, 2, 2]]
    assert [(g.prefix_len, g.members) for g in group_prefixes(seqs)] == [
        (0, (3,)),
        (3, (1, 4)),
        (2, (0, 2)),
    ]
    assert group_prefixes([]) == []


def test_large_token_ids_and_long_shared_prefixes() -> None:
    rng = np.random.default_rng(0)
    doc = rng.integers(0, 2**31 - 1, 10_000, dtype=np.int64)
    seqs = [np.concatenate([doc, [q, q + 1]]) for q in range(3)] + [doc[:5000]]
    groups = group_prefixes(seqs)
    # (3 - 1) * 5000 > 5000: the full document is split off; the half-document row is alone.
    assert [(g.prefix_len, g.members) for g in groups] == [(0, (3,)), (10_000, (0, 1, 2))]
    assert optimal_saving_ratio(seqs) == pytest.approx(1 - (10_000 + 6) / 35_006)


@pytest.mark.parametrize(
    ("seqs", "min_shared", "message"),
    [
        ("abc", 1, "seqs must be a list of token sequences"),
        ([[1, 2], "ab"], 1, r"seqs\[1\] must be a sequence of token ids"),
        ([[1, 2.5]], 1, r"seqs\[0\]\[1\] must be an integer token id in 0..2147483647, got 2.5"),
        ([[1, 2**70]], 1, r"seqs\[0\]\[1\] must be an integer token id in .*, got 1180591"),
        ([[True, False]], 1, r"seqs\[0\]\[0\] must be an integer token id .*, got True"),
        ([[1, [2]]], 1, r"seqs\[0\] must be a flat sequence of token ids, got \[1, \[2\]\]"),
        ([[1, -1]], 1, "token ids must be in 0..2147483647, got -1"),
        ([[2**31]], 1, "token ids must be in 0..2147483647, got 2147483648"),
        ([np.zeros((2, 2), dtype=np.int32)], 1, r"seqs\[0\] must be a 1-D integer array"),
        ([np.zeros(2)], 1, r"seqs\[0\] must be a 1-D integer array, got shape \(2,\) dtype"),
        ([[1]], 0, "min_shared must be a positive integer, got 0"),
        ([[1]], True, "min_shared must be a positive integer, got True"),
    ],
)
def test_group_prefixes_rejects_bad_input(seqs: object, min_shared: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        group_prefixes(seqs, min_shared=min_shared)  # type: ignore[arg-type]


def test_prefix_group_checks_its_fields() -> None:
    assert PrefixGroup(3, (1, 4, 9)).share_degree == 3
    with pytest.raises(ValueError, match="prefix_len must be a non-negative integer, got -1"):
        PrefixGroup(-1, (0,))
    with pytest.raises(ValueError, match="members must be ascending row indices"):
        PrefixGroup(0, (2, 1))
    with pytest.raises(ValueError, match="members must be ascending row indices"):
        PrefixGroup(0, (1, 1))
    with pytest.raises(ValueError, match="at least one member"):
        PrefixGroup(0, ())
