"""Greedy bin-packing heuristics over prompt lengths: FFD, BFD, PackInfer's balanced groups and
the length-ordered baseline.

Each takes lengths already validated by `packing.bins.pack` and returns bins of item indices,
in the order the method opened them. `packing.optimal` uses FFD and BFD as its upper bound, so
they live here, apart from `pack`, which dispatches to both modules.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Sequence

import numpy as np


def decreasing_order(lengths: Sequence[int]) -> list[int]:
    """Item indices by decreasing length, equal lengths in index order."""
    # A stable sort on the negated lengths keeps ties in index order.
    neg = -np.asarray(lengths, dtype=np.int64)
    order: list[int] = np.argsort(neg, kind="stable").tolist()
    return order


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """FFD with a max segment tree over bins, O(n log n) instead of O(n * bins).

    Every leaf starts at `capacity`: bins not yet opened are empty and lie to the right of the
    open ones, so "the leftmost leaf with room" is the first open bin that fits, or else the
    next new bin, and no separate "open a bin" case is needed.
    """
    order = decreasing_order(lengths)
    n = len(order)
    size = 1
    while size < n:
        size *= 2
    tree = [capacity] * (2 * size)  # tree[v] = most room left in any bin under node v
    bins: list[list[int]] = []
    i = 0
    while i < n:
        item = order[i]
        s = lengths[item]
        node = 1
        while node < size:
            node *= 2
            if tree[node] < s:
                node += 1
        b = node - size
        if b == len(bins):
            bins.append([])
        room = tree[node] - s
        bins[b].append(item)
        i += 1
        # Equal lengths keep going into the same bin while it has room: it stays the leftmost
        # fit, so this is still first fit, with one tree update instead of many.
        while i < n and room >= s and lengths[order[i]] == s:
            bins[b].append(order[i])
            room -= s
            i += 1
        tree[node] = room
        node //= 2
        while node:
            left, right = tree[2 * node], tree[2 * node + 1]
            best = left if left > right else right
            if tree[node] == best:
                break  # nothing above changes
            tree[node] = best
            node //= 2
    return bins


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """BFD: each item (longest first) into the open bin with the least room that still fits.

    Bins are bucketed by room left; `rooms` is the sorted list of non-empty buckets, so the
    best fit is one bisect away and ties go to the lowest bin index (a heap per bucket).
    """
    bins: list[list[int]] = []
    buckets: dict[int, list[int]] = {}  # room left -> heap of bin indices
    rooms: list[int] = []  # sorted keys of non-empty buckets
    for item in decreasing_order(lengths):
        s = lengths[item]
        k = bisect_left(rooms, s)
        if k == len(rooms):
            b = len(bins)
            bins.append([])
            room = capacity
        else:
            room = rooms[k]
            b = heapq.heappop(buckets[room])
            if not buckets[room]:
                del buckets[room]
                del rooms[k]
        bins[b].append(item)
        room -= s
        if room > 0:  # a full bin never fits another item (lengths are >= 1)
            if room not in buckets:
                buckets[room] = []
                insort(rooms, room)
            heapq.heappush(buckets[room], b)
    return bins


def balanced(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """PackInfer's length-balanced groups (see `pack`), least-loaded group first, ties by index.

    If the least-loaded group cannot take an item no group can, so one heap look-up decides.
    """
    total = sum(lengths)
    target = -(-total // capacity)
    heap = [(0, g) for g in range(target)]  # (load, group index)
    groups: list[list[int]] = [[] for _ in range(target)]
    for item in decreasing_order(lengths):
        s = lengths[item]
        load, g = heap[0]
        if load + s <= capacity:
            heapq.heapreplace(heap, (load + s, g))
        else:
            g = len(groups)
            groups.append([])
            heapq.heappush(heap, (s, g))
        groups[g].append(item)
    return [g for g in groups if g]


def length_ordered(lengths: Sequence[int], capacity: int, batch_size: int) -> list[list[int]]:
    """Sort by ascending length (ties by index), chunk by `batch_size`, split over-full chunks.

    A chunk whose total exceeds `capacity` is cut greedily, in sorted order, into consecutive
    pieces that fit, so the baseline keeps its order and still respects the capacity.
    """
    order: list[int] = np.argsort(np.asarray(lengths), kind="stable").tolist()
    bins: list[list[int]] = []
    for start in range(0, len(order), batch_size):
        current: list[int] = []
        load = 0
        for item in order[start : start + batch_size]:
            if load + lengths[item] > capacity:
                bins.append(current)
                current, load = [], 0
            current.append(item)
            load += lengths[item]
        bins.append(current)
    return bins
