"""Chained block hashes (as a paged KV cache keys its blocks) and the planner's shard key.

The hash of block i covers block i's tokens and the hash of block i-1, so two sequences get
equal hashes for block i exactly when their first i+1 blocks are equal (up to 64-bit
collisions). The bytes hashed are fixed (8-byte blake2b over the previous block's digest and
the block's tokens as little-endian int32), never Python's salted hash(), so every process
and machine agrees: the
engine's KV-cache manager uses this same function for block-level prefix caching.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from packing._checks import positive_int, token_array

# The "previous hash" of block 0. Any constant works; it only has to be the same everywhere.
_ROOT = bytes(8)


def block_hashes(tokens: Sequence[int] | npt.NDArray[np.integer], block_size: int) -> list[int]:
    """Chained 64-bit hashes of the full blocks of `tokens`, one per block, in order.

    A trailing partial block has no hash (it may still grow). Equal leading blocks give equal
    hashes, and a sequence's hashes are a prefix of any extension's hashes. Hashes are ints in
    0..2**64-1. Raises ValueError for a block_size < 1 or token ids outside 0..2**31-1.
    """
    size = positive_int("block_size", block_size)
    arr = token_array("tokens", tokens)
    return _chain(arr, size, arr.shape[0] // size)


def prefix_key(
    tokens: Sequence[int] | npt.NDArray[np.integer], block_size: int = 64, num_blocks: int = 1
) -> int | None:
    """A shard key: the chained hash of the first `num_blocks` full blocks, None if none.

    Rows sharing at least block_size * num_blocks leading tokens get the same key, with no
    global tree: the planner shuffles rows by key so that all rows that can share that much
    meet in one place. A row with fewer than block_size tokens has no key (the caller keys it
    by itself); a row with some but fewer than num_blocks full blocks is keyed by the full
    blocks it has (it cannot share num_blocks blocks with anyone, so this loses nothing).
    """
    size = positive_int("block_size", block_size)
    count = positive_int("num_blocks", num_blocks)
    arr = token_array("tokens", tokens)
    full = min(count, arr.shape[0] // size)
    if full == 0:
        return None
    return _chain(arr, size, full)[-1]


def _chain(arr: npt.NDArray[np.int64], block_size: int, num_blocks: int) -> list[int]:
    data = arr[: num_blocks * block_size].astype("<i4").tobytes()
    step = 4 * block_size
    out: list[int] = []
    previous = _ROOT
    for start in range(0, num_blocks * step, step):
        digest = hashlib.blake2b(previous + data[start : start + step], digest_size=8).digest()
        out.append(int.from_bytes(digest, "little"))
        previous = digest
    return out
