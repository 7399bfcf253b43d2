"""A radix tree over token sequences, built from sorted order and LCPs instead of a trie.

A node-per-token trie in Python costs microseconds per token; here the tree costs numpy work
per token and Python work per sequence. Sequences are sorted lexicographically (as big-endian
bytes, whose order is the token order for non-negative ids), the longest common prefix (LCP)
of each sorted neighbour pair is found vectorised, and the radix tree's internal nodes are
exactly the LCP intervals: a maximal run of sorted sequences whose neighbour LCPs are all >=
some depth d, with d reached somewhere inside. One stack walk over the LCP array finds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

from packing._checks import MAX_TOKEN_ID, check_token_range, describe, is_int

IntArray = npt.NDArray[np.int64]

# Widest comparison window of the LCP search, and how many token pairs one round may compare.
_MAX_WINDOW = 4096
_ROUND_BUDGET = 1 << 22


@dataclass(frozen=True)
class TokenTable:
    """Many token sequences in one flat array (the layout the LCP search needs)."""

    # [total_tokens + _MAX_WINDOW] big-endian int32 token ids seen as uint32 (only ever
    # compared for equality or as bytes), zero padding at the end for the LCP windows
    flat: npt.NDArray[np.uint32]
    starts: IntArray  # [num_seqs] offset of each sequence in `flat`
    lengths: IntArray  # [num_seqs]

    @property
    def num_seqs(self) -> int:
        """How many sequences the table holds."""
        return int(self.lengths.shape[0])

    @property
    def num_tokens(self) -> int:
        """Total tokens over all sequences."""
        return int(self.lengths.sum())


def token_table(seqs: Sequence[Sequence[int]] | Sequence[npt.NDArray[np.integer]]) -> TokenTable:
    """Validate `seqs` (token id lists or 1-D integer arrays) and lay them out flat.

    Arrays are the fast path (one concatenate); lists of Python ints are converted one by one.
    """
    if isinstance(seqs, str | bytes | np.ndarray) or not isinstance(seqs, Sequence):
        raise ValueError(f"seqs must be a list of token sequences, got {describe(seqs)}")
    arrays = cast(list[npt.NDArray[np.integer]], list(seqs))
    # The planner's common case, 1-D integer arrays, is checked in two C-speed passes.
    if not (
        all(type(a) is np.ndarray for a in arrays)
        and {(a.ndim, a.dtype.kind) for a in arrays} <= {(1, "i"), (1, "u")}
    ):
        arrays = [_as_array(i, seq) for i, seq in enumerate(seqs)]
    lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
    starts = np.zeros(len(arrays), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    total = int(lengths.sum())
    tokens = np.concatenate(arrays) if total else np.zeros(0, dtype=np.int64)
    if tokens.dtype.kind not in "iu":  # only empty sequences: concatenate made floats
        tokens = tokens.astype(np.int64)
    check_token_range("seqs (all tokens)", tokens)
    # Stored big-endian: the bytes of a sequence then sort like its tokens (see
    # sort_sequences), and equality tests do not care about byte order.
    flat = np.zeros(total + _MAX_WINDOW, dtype=">i4")
    flat[:total] = tokens
    return TokenTable(flat.view(np.uint32), starts, lengths)


def _as_array(i: int, seq: object) -> npt.NDArray[np.integer]:
    """Sequence i as a 1-D integer array, or ValueError saying what is wrong with it."""
    if isinstance(seq, str | bytes) or not isinstance(seq, Sequence | np.ndarray):
        raise ValueError(f"seqs[{i}] must be a sequence of token ids, got {describe(seq)}")
    try:
        arr = np.asarray(seq)  # C-speed for lists of ints; other element types show in the dtype
    except (ValueError, TypeError):
        raise ValueError(
            f"seqs[{i}] must be a flat sequence of token ids, got {describe(seq)}"
        ) from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        if isinstance(seq, np.ndarray) or arr.ndim != 1:
            raise ValueError(
                f"seqs[{i}] must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}"
            )
        bad = next((j for j, t in enumerate(seq) if not is_int(t) or not 0 <= t <= MAX_TOKEN_ID), 0)
        raise ValueError(
            f"seqs[{i}][{bad}] must be an integer token id in 0..{MAX_TOKEN_ID}, "
            f"got {describe(seq[bad])}"
        )
    return arr


def sort_sequences(table: TokenTable) -> IntArray:
    """Sequence indices in lexicographic token order; equal sequences stay in index order."""
    n = table.num_seqs
    total = table.num_tokens
    # Big-endian bytes compare like the token sequences they encode (ids are >= 0), and a
    # proper prefix sorts first, so Python's bytes sort (memcmp, stable) does the work.
    blob = table.flat[:total].tobytes()
    begin = (table.starts * 4).tolist()
    end = ((table.starts + table.lengths) * 4).tolist()
    keys = [blob[b:e] for b, e in zip(begin, end, strict=True)]
    order = sorted(range(n), key=keys.__getitem__)
    return np.asarray(order, dtype=np.int64)


def neighbour_lcp(table: TokenTable, order: IntArray) -> IntArray:
    """LCP[i] = common prefix length of sequences order[i] and order[i+1]; shape [n - 1].

    Compares all pairs at once in windows that double in width (16, 32, ... tokens), so a
    pair costs about twice its LCP in compared tokens and the rounds stay few. Pairs are
    done when a window shows a mismatch or reaches the shorter sequence's end; tokens read
    past a sequence's end are ignored by capping at that length.
    """
    pairs = order.shape[0] - 1
    lcp = np.zeros(max(pairs, 0), dtype=np.int64)
    if pairs <= 0:
        return lcp
    left, right = table.starts[order[:-1]], table.starts[order[1:]]
    shorter = np.minimum(table.lengths[order[:-1]], table.lengths[order[1:]])
    active = np.flatnonzero(shorter > 0)
    offset, width = 0, 16
    while active.size:
        w = int(min(width, _MAX_WINDOW, max(16, _ROUND_BUDGET // active.size)))
        windows = sliding_window_view(table.flat, w)  # [num_positions, w] view, no copy
        differ = windows[left[active] + offset] != windows[right[active] + offset]
        first = differ.argmax(axis=1)  # 0 when no mismatch; told apart below
        mismatch = differ[np.arange(active.size), first]
        cap = shorter[active]
        found = np.where(mismatch, offset + first, cap)
        done = mismatch | (offset + w >= cap)
        lcp[active[done]] = np.minimum(found[done], cap[done])
        active = active[~done]
        offset += w
        width *= 2
    return lcp


@dataclass(frozen=True)
class SortedSequences:
    """Sequences in lexicographic order with their sorted neighbours' LCPs: all a radix tree
    over them, or over any subset of them (`subset`), needs, so a planner sorts and compares
    a partition's tokens once and derives each bucket's and each shard's tree from that.

    Made by `of`; `group_prefixes`, `prefix_forest` and `optimal_saving_ratio` take one in
    place of the sequences themselves.
    """

    lengths: IntArray  # [n] tokens of each sequence
    order: IntArray  # [n] sequence indices in lexicographic order, equal ones by index
    lcp: IntArray  # [n - 1] common prefix of sorted neighbours order[i] and order[i + 1]

    @classmethod
    def of(
        cls, seqs: Sequence[Sequence[int]] | Sequence[npt.NDArray[np.integer]]
    ) -> SortedSequences:
        """Validate, sort and compare `seqs` (token id lists or 1-D integer arrays)."""
        table = token_table(seqs)
        order = sort_sequences(table)
        return cls(table.lengths, order, neighbour_lcp(table, order))

    @property
    def num_seqs(self) -> int:
        """How many sequences there are."""
        return int(self.lengths.shape[0])

    @property
    def num_tokens(self) -> int:
        """Total tokens over all sequences."""
        return int(self.lengths.sum())

    def subset(self, rows: Sequence[int] | IntArray) -> SortedSequences:
        """Sequences rows[0], rows[1], ... (distinct indices into these, any order) as
        `of([seqs[r] for r in rows])` would give them, without touching a token: the subset's
        sorted order is the sorted order restricted to it, and the LCP of two sequences is
        the minimum of the neighbour LCPs between their sorted positions."""
        picked = np.asarray(rows, dtype=np.int64).reshape(-1)
        n = picked.shape[0]
        rank = np.empty(self.num_seqs, dtype=np.int64)
        rank[self.order] = np.arange(self.num_seqs)
        position = rank[picked]
        local = np.argsort(position, kind="stable")  # subset indices in sorted order
        sorted_position = position[local]
        lcp = np.zeros(max(n - 1, 0), dtype=np.int64)
        if n >= 2:
            spans = np.stack([sorted_position[:-1], sorted_position[1:]], axis=1).ravel()
            lcp = np.minimum.reduceat(np.append(self.lcp, 0), spans)[::2]
        lengths = self.lengths[picked]
        # Equal sequences sort by index: by the subset's own, as a fresh sort would do.
        equal = (lcp == lengths[local[:-1]]) & (lcp == lengths[local[1:]])
        run = np.concatenate([[0], np.cumsum(~equal)]) if n else np.zeros(0, dtype=np.int64)
        local = local[np.lexsort((local, run))]
        return SortedSequences(lengths, local, lcp)


@dataclass(frozen=True)
class RadixTree:
    """Internal nodes of the radix tree over the sorted sequences (node 0 is the root).

    Node v covers the sorted positions lo[v]..hi[v] (inclusive), i.e. the sequences sharing
    its first depth[v] tokens. Leaves are the sequences themselves and are not stored; a
    sequence that ends exactly at a node (its whole length shared) is a leaf with no tokens.
    owner[p] is the deepest node covering sorted position p: the node the leaf hangs from.
    """

    depth: list[int]
    lo: list[int]
    hi: list[int]
    parent: list[int]
    owner: list[int]

    def children(self) -> list[list[int]]:
        """Internal children of every node, in sorted (left to right) order."""
        kids: list[list[int]] = [[] for _ in self.depth]
        for v in range(1, len(self.depth)):
            kids[self.parent[v]].append(v)
        for k in kids:
            k.sort(key=self.lo.__getitem__)
        return kids

    def leaves(self, v: int) -> int:
        """Number of sequences in node v's subtree."""
        return self.hi[v] - self.lo[v] + 1


def radix_tree(lcp: Sequence[int], num_seqs: int) -> RadixTree:
    """The LCP-interval tree of `num_seqs` sorted sequences (one stack walk, O(n))."""
    depth, lo, hi, parent = [0], [0], [max(num_seqs - 1, 0)], [-1]
    stack = [0]
    # top[j] = deepest open node covering positions j-1 and j once boundary j is done.
    top = [0]
    for j, d in enumerate([*lcp, 0], start=1):  # d = LCP of sorted positions j-1 and j
        last = -1
        while depth[stack[-1]] > d:
            last = stack.pop()
            hi[last] = j - 1
        if depth[stack[-1]] < d:
            # A new interval starts where the last closed one did (it becomes our child).
            depth.append(d)
            lo.append(lo[last] if last >= 0 else j - 1)
            hi.append(-1)
            parent.append(stack[-1])
            if last >= 0:
                parent[last] = len(depth) - 1
            stack.append(len(depth) - 1)
        top.append(stack[-1])
    # A leaf hangs from the deeper of the nodes shared with its left and right neighbours.
    owner = [a if depth[a] >= depth[b] else b for a, b in zip(top[:-1], top[1:], strict=True)]
    return RadixTree(depth, lo, hi, parent, owner)
