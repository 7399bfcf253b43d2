"""Exact bin packing for small inputs: the fewest bins, by branch and bound.

Our own solver rather than OR-Tools or a MIP library: the exact case is small (<= 64 items,
e.g. one online admission window or a benchmark baseline), and a heavy native dependency in
`packing/` would have to ship to every Ray worker for it.

The search is Korf's bin completion: bins are filled one at a time, each around the largest
item left, trying only undominated ways to fill the rest of that bin, longest items first.
It runs
for k = the Martello-Toth L2 lower bound upwards and stops below the best greedy result
(FFD/BFD, the upper bound); most inputs never search because the greedy result already meets
the lower bound. Bin packing is NP-hard, so a search that has not finished within
MAX_SEARCH_STEPS raises ValueError instead of running for hours; realistic prompt lengths
finish in milliseconds, adversarial near-perfect-fit sets near 64 items can hit the limit.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Iterator, Sequence

from packing.greedy import best_fit_decreasing, first_fit_decreasing

MAX_OPTIMAL_ITEMS = 64
MAX_SEARCH_STEPS = 250_000


def lower_bound_l1(lengths: Sequence[int], capacity: int) -> int:
    """The continuous bound ceil(total / capacity)."""
    return -(-sum(lengths) // capacity)


def lower_bound_l2(lengths: Sequence[int], capacity: int) -> int:
    """Martello and Toth's L2 bound (>= L1): items too large to share a bin are counted apart.

    For each threshold k in {0} and the lengths <= capacity/2: items longer than capacity - k
    each need their own bin (n1); items in (capacity/2, capacity - k] need their own bins too
    (n2), whose leftover room may take items in [k, capacity/2]; whatever of those does not
    fit there needs ceil(rest / capacity) more bins.
    """
    best = lower_bound_l1(lengths, capacity)
    for k in sorted({0, *(x for x in lengths if 2 * x <= capacity)}):
        n1 = n2 = sum2 = sum3 = 0
        for x in lengths:
            if x > capacity - k:
                n1 += 1
            elif 2 * x > capacity:
                n2 += 1
                sum2 += x
            elif x >= k:
                sum3 += x
        spill = sum3 - (n2 * capacity - sum2)
        best = max(best, n1 + n2 + max(0, -(-spill // capacity)))
    return best


def pack_optimal(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices using the fewest bins possible (items already validated by `pack`).

    Raises ValueError above MAX_OPTIMAL_ITEMS items, or when the search needs more than
    MAX_SEARCH_STEPS steps (a few seconds); "ffd" (at most 11/9 OPT + 6/9 bins) is the
    fallback for both.
    """
    if len(lengths) > MAX_OPTIMAL_ITEMS:
        raise ValueError(
            f'method "optimal" is exact for at most {MAX_OPTIMAL_ITEMS} items, got '
            f'{len(lengths)}; use "ffd" for larger inputs'
        )
    best = min(
        first_fit_decreasing(lengths, capacity),
        best_fit_decreasing(lengths, capacity),
        key=len,
    )
    search = _BinCompletion(lengths, capacity)
    for k in range(lower_bound_l2(lengths, capacity), len(best)):
        found = search.run(k)
        if found is not None:
            return found
    return best


class _BinCompletion:
    """Feasibility search "do the items fit in k bins?" over multisets of lengths.

    Items of equal length are interchangeable, so the state is a count per distinct length
    (`sizes` descending, `counts`), which removes the symmetric branches an item-by-item
    search would explore, and makes failed states easy to remember.
    """

    def __init__(self, lengths: Sequence[int], capacity: int) -> None:
        tally = Counter(lengths)
        self.sizes = sorted(tally, reverse=True)
        self.ascending = self.sizes[::-1]  # for bisect: the first size that fits a gap
        self.initial = [tally[s] for s in self.sizes]
        self.capacity = capacity
        self.lengths = lengths
        self.steps = 0

    def run(self, k: int) -> list[list[int]] | None:
        """Bins of item indices in at most k bins, or None when k bins cannot hold them."""
        self.counts = list(self.initial)
        self.failed: set[tuple[int, ...]] = set()
        self.bins: list[list[int]] = []  # indices into `sizes`
        if not self._solve(k, sum(self.lengths)):
            return None
        pools: dict[int, list[int]] = {}
        for i in reversed(range(len(self.lengths))):
            pools.setdefault(self.lengths[i], []).append(i)
        return [[pools[self.sizes[q]].pop() for q in b] for b in self.bins]

    def _solve(self, bins_left: int, remaining: int) -> bool:
        if remaining == 0:
            return True
        waste = bins_left * self.capacity - remaining  # room that may stay empty
        if waste < 0:
            return False
        counts = self.counts
        key = (bins_left, *counts)
        if key in self.failed:
            return False
        self._tick()
        first = next(q for q, c in enumerate(counts) if c)
        counts[first] -= 1
        room = self.capacity - self.sizes[first]
        for used, chosen in self._completions(first, room, room - waste):
            for q in chosen:
                counts[q] -= 1
            self.bins.append([first, *chosen])
            if self._solve(bins_left - 1, remaining - self.sizes[first] - used):
                return True
            self.bins.pop()
            for q in chosen:
                counts[q] += 1
        counts[first] += 1
        self.failed.add(key)
        return False

    def _completions(self, first: int, room: int, lower: int) -> Iterator[tuple[int, list[int]]]:
        """Undominated ways to fill `room` with at least `lower`, generated lazily.

        Depth-first, taking as many of the longest items as fit first, so full bins come
        early. Only maximal fillings (no item left over still fits) are kept, and a filling
        is dominated when one unused item could replace one or two chosen items, filling at
        least as much and still fitting: Martello and Toth showed some optimal packing
        avoids dominated bins, so skipping them loses nothing. Each step counts against the
        search budget, because the number of fillings can itself be exponential.
        """
        sizes, counts, m = self.sizes, self.counts, len(self.sizes)
        take = [0] * m
        chosen: list[int] = []
        suffix = [0] * (m + 1)  # suffix[q] = total length of the items q.. still available
        for q in range(m - 1, first - 1, -1):
            suffix[q] = suffix[q + 1] + sizes[q] * counts[q]

        def visit(q: int, used: int) -> Iterator[tuple[int, list[int]]]:
            self._tick()
            gap = room - used
            q = max(q, m - bisect_left(self.ascending, gap + 1))  # first size that fits
            if used + suffix[q] < lower:
                return
            if q < m:
                for c in range(min(counts[q], gap // sizes[q]), -1, -1):
                    take[q] = c
                    chosen.extend([q] * c)
                    yield from visit(q + 1, used + sizes[q] * c)
                    if c:
                        del chosen[-c:]
                take[q] = 0
                return
            unused = [sizes[j] for j in range(first, m) if counts[j] > take[j]]
            if unused and unused[-1] <= gap:
                return  # not maximal
            for y in unused:
                for i, a in enumerate(chosen):
                    sa = sizes[a]
                    if sa < y <= sa + gap:
                        return
                    for b in chosen[i + 1 :]:
                        if sa + sizes[b] <= y <= sa + sizes[b] + gap:
                            return
            yield used, list(chosen)

        yield from visit(first, 0)

    def _tick(self) -> None:
        self.steps += 1
        if self.steps > MAX_SEARCH_STEPS:
            raise ValueError(
                f'method "optimal" gave up after {MAX_SEARCH_STEPS} search steps on '
                f'{len(self.lengths)} items (a near-perfect-fit input); use "ffd"'
            )
