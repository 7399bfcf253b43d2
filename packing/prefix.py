"""Global prefix grouping (BatchLLM, arXiv 2412.03594, Section 3 and Algorithm 1).

A batch's prompts form a radix tree; sharing is many-levelled, but an engine that computes
one shared prefix per group and then each member's suffix needs one level. BatchLLM turns the
tree into one level by "first-level prefix enlargement": a first-level node c keeps the whole
subtree below it unless a grandchild g (a child of c in the tree) is worth splitting off into
a group of its own with the longer prefix c+g, which is when the tokens it saves,
(leaves(g) - 1) * tokens(g), exceed the tokens it costs, tokens(c) computed a second time.
A split-off node becomes a first-level node itself and is examined the same way, so a deep
prefix shared by many beats a shallow one shared by few.

Conventions: a group with one member shares nothing, so its prefix_len is 0; `min_shared`
cuts the tree: the first-level nodes are the shallowest nodes with at least `min_shared`
tokens. Groups come in lexicographic order of their first member's tokens (the radix tree's
depth-first order), so neighbouring groups tend to share deeper prefixes too; members are
ascending row indices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from packing._checks import describe, is_int, positive_int
from packing.radix import RadixTree, neighbour_lcp, radix_tree, sort_sequences, token_table

Seqs = Sequence[Sequence[int]] | Sequence[npt.NDArray[np.integer]]


@dataclass(frozen=True, slots=True)
class PrefixGroup:
    """Rows that share their first `prefix_len` tokens; the prefix is computed once for all."""

    prefix_len: int  # tokens shared by every member (the group's first-level prefix)
    members: tuple[int, ...]  # indices into the input sequences, ascending

    def __post_init__(self) -> None:
        if not is_int(self.prefix_len) or self.prefix_len < 0:
            raise ValueError(
                f"prefix_len must be a non-negative integer, got {describe(self.prefix_len)}"
            )
        previous = -1
        for m in self.members:
            if not is_int(m) or m <= previous:
                raise ValueError(f"members must be ascending row indices, got {self.members!r}")
            previous = m
        if not self.members:
            raise ValueError("a prefix group needs at least one member, got none")

    @classmethod
    def _unchecked(cls, prefix_len: int, members: tuple[int, ...]) -> PrefixGroup:
        # group_prefixes builds groups that are valid by construction; skipping the checks
        # keeps planning at O(1) Python work per row (the checks are per member).
        group = object.__new__(cls)
        object.__setattr__(group, "prefix_len", prefix_len)
        object.__setattr__(group, "members", members)
        return group

    @property
    def share_degree(self) -> int:
        """How many rows share the prefix."""
        return len(self.members)


def group_prefixes(seqs: Seqs, min_shared: int = 1) -> list[PrefixGroup]:
    """Partition token sequences into prefix groups by BatchLLM's first-level enlargement.

    Every sequence is in exactly one group; the members of a group with two or more members
    share exactly their `prefix_len` >= `min_shared` leading tokens (their true longest common
    prefix). Sequences are lists of token ids or 1-D integer arrays (faster); ids must be in
    0..2**31-1. An empty input gives []. Cost: one sort of the sequences as bytes, numpy
    comparisons over the shared tokens, and O(number of sequences) Python work.
    """
    min_shared = positive_int("min_shared", min_shared)
    table = token_table(seqs)
    n = table.num_seqs
    if n == 0:
        return []
    order = sort_sequences(table)
    lcp = neighbour_lcp(table, order)
    tree = radix_tree(lcp.tolist(), n)
    heads = enlarge_first_level(tree, min_shared)

    # Label each sorted position with its head; split-off heads come after their parents,
    # so their labels overwrite the parent's on their own ranges.
    label = np.full(n, -1, dtype=np.int64)
    for h, v in enumerate(heads):
        label[tree.lo[v] : tree.hi[v] + 1] = h
    positions = np.arange(n, dtype=np.int64)
    size = np.bincount(label[label >= 0], minlength=len(heads) + 1)  # +1: never empty
    shared = (label >= 0) & (size[np.maximum(label, 0)] >= 2)
    group_id = np.where(shared, label, len(heads) + positions)
    _, first, inverse = np.unique(group_id, return_index=True, return_inverse=True)
    rank = np.empty_like(first)
    rank[np.argsort(first, kind="stable")] = np.arange(first.shape[0])
    group_of = rank[inverse]  # [n] output group of each sorted position
    num_groups = first.shape[0]

    # A group's true common prefix is the minimum neighbour LCP between its first and last
    # sorted member; reduceat over (first, last) index pairs does all groups at once.
    counts = np.bincount(group_of, minlength=num_groups)
    lo = np.full(num_groups, n, dtype=np.int64)
    hi = np.zeros(num_groups, dtype=np.int64)
    np.minimum.at(lo, group_of, positions)
    np.maximum.at(hi, group_of, positions)
    prefix = np.zeros(num_groups, dtype=np.int64)
    multi = np.flatnonzero(counts >= 2)
    if multi.size:
        padded = np.append(lcp, 0)
        spans = np.stack([lo[multi], hi[multi]], axis=1).ravel()
        prefix[multi] = np.minimum.reduceat(padded, spans)[::2]

    by_group = np.lexsort((order, group_of))
    rows: list[int] = order[by_group].tolist()
    ends = np.cumsum(counts).tolist()
    prefix_list: list[int] = prefix.tolist()
    groups: list[PrefixGroup] = []
    start = 0
    for g, end in enumerate(ends):
        groups.append(PrefixGroup._unchecked(prefix_list[g], tuple(rows[start:end])))
        start = end
    return groups


def enlarge_first_level(tree: RadixTree, min_shared: int) -> list[int]:
    """BatchLLM's Algorithm 1 on `tree`: the group heads, each before any head split from it.

    The first-level nodes are the shallowest nodes at depth >= min_shared. For each head c
    (first-level, or split off earlier), a child g is split off into its own head when
    (leaves(g) - 1) * (depth(g) - depth(c)) > depth(c). A leaf never qualifies (one leaf).
    """
    kids = tree.children()
    depth = tree.depth
    heads: list[int] = []
    frontier = [0]
    while frontier:  # descend from the root to the first level
        v = frontier.pop()
        if depth[v] >= min_shared:
            heads.append(v)
        else:
            frontier.extend(kids[v])
    heads.sort(key=tree.lo.__getitem__)
    for c in heads:  # `heads` grows while we walk it: split-off nodes are examined in turn
        for g in kids[c]:
            if (tree.leaves(g) - 1) * (depth[g] - depth[c]) > depth[c]:
                heads.append(g)
    return heads


def _lengths(seqs: Seqs) -> list[int]:
    if isinstance(seqs, str | bytes | np.ndarray) or not isinstance(seqs, Sequence):
        raise ValueError(f"seqs must be a list of token sequences, got {describe(seqs)}")
    return [len(s) for s in seqs]


def saving_ratio(seqs: Seqs, groups: Sequence[PrefixGroup]) -> float:
    """BatchLLM's Eq. 2: 1 - processed prefill tokens / logical prefill tokens.

    processed = sum over groups of prefix_len + sum over members of (length - prefix_len).
    `groups` must cover every sequence exactly once with prefix_len <= each member's length;
    that the prefix is really shared is trusted (group_prefixes guarantees it). 0.0 when
    there are no tokens.
    """
    lengths = _lengths(seqs)
    seen = [False] * len(lengths)
    processed = 0
    for g in groups:
        for m in g.members:
            if not 0 <= m < len(lengths) or seen[m]:
                raise ValueError(
                    f"groups must cover the {len(lengths)} sequences exactly once; row {m} is "
                    + ("out of range" if not 0 <= m < len(lengths) else "in two groups")
                )
            if lengths[m] < g.prefix_len:
                raise ValueError(
                    f"row {m} has {lengths[m]} tokens, fewer than its group's prefix_len "
                    f"{g.prefix_len}"
                )
            seen[m] = True
            processed += lengths[m] - g.prefix_len
        processed += g.prefix_len
    if not all(seen):
        raise ValueError(f"groups miss row {seen.index(False)} of {len(lengths)}")
    logical = sum(lengths)
    return 1.0 - processed / logical if logical else 0.0


def optimal_saving_ratio(seqs: Seqs) -> float:
    """The best saving ratio any sharing scheme can reach: every distinct prefix computed once.

    Processed tokens are the nodes of the full token trie, total - sum of the LCPs of sorted
    neighbours, so the ratio is sum(LCP) / total. 0.0 when there are no tokens.
    """
    table = token_table(seqs)
    total = table.num_tokens
    if total == 0:
        return 0.0
    lcp = neighbour_lcp(table, sort_sequences(table))
    return float(lcp.sum()) / total
