"""Bin packing of prompt lengths into fixed-capacity rows (Prepacking, PackInfer, baselines).

`pack` returns bins of item indices whose lengths sum to at most `capacity`. Every method is
deterministic: items of equal length are taken in index order, and each bin lists its item
indices in ascending order; bins come in the order the method opened them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from packing._checks import describe, int_list, positive_int
from packing.greedy import balanced, best_fit_decreasing, first_fit_decreasing, length_ordered
from packing.optimal import pack_optimal

METHODS = ("ffd", "bfd", "balanced", "optimal", "length_ordered")


def pack(
    lengths: Sequence[int],
    capacity: int,
    method: str = "ffd",
    *,
    batch_size: int | None = None,
) -> list[list[int]]:
    """Pack items of the given lengths into bins of at most `capacity` total length.

    Methods:
      "ffd": first-fit decreasing (Prepacking's choice); at most 11/9 OPT + 6/9 bins.
      "bfd": best-fit decreasing (the fitting bin with the least room left).
      "balanced": PackInfer's length-balanced groups: start ceil(total / capacity) groups, put
        each item (largest first) into the least-loaded group if it fits, else open a group.
      "optimal": the minimum number of bins (branch and bound; at most 64 items).
      "length_ordered": the sort-and-chunk baseline: items sorted by ascending length, cut into
        chunks of `batch_size` items, a chunk split further where it would exceed `capacity`.

    An empty `lengths` gives `[]`. Raises ValueError for a length < 1 or not an integer, a
    capacity < 1, an item longer than `capacity` (naming the item), an unknown method, a
    missing `batch_size` for "length_ordered" or one given for another method.
    """
    items = int_list("lengths", lengths, minimum=1)
    cap = positive_int("capacity", capacity)
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {describe(method)}")
    if method == "length_ordered":
        if batch_size is None:
            raise ValueError('method "length_ordered" needs batch_size (items per chunk)')
        chunk = positive_int("batch_size", batch_size)
    elif batch_size is not None:
        raise ValueError(f'batch_size only applies to method "length_ordered", not "{method}"')
    for i, length in enumerate(items):
        if length > cap:
            raise ValueError(f"item {i} has length {length}, more than the capacity {cap}")
    if not items:
        return []
    if method == "length_ordered":
        bins = length_ordered(items, cap, chunk)
    elif method == "optimal":
        bins = pack_optimal(items, cap)
    else:
        bins = _GREEDY[method](items, cap)
    return [sorted(b) for b in bins]


_GREEDY: dict[str, Callable[[Sequence[int], int], list[list[int]]]] = {
    "ffd": first_fit_decreasing,
    "bfd": best_fit_decreasing,
    "balanced": balanced,
}
