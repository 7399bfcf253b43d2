"""packing.keys: chained block hashes and prefix keys."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packing.keys import block_hashes, prefix_key

tokens = st.lists(st.integers(0, 5), max_size=40)
sizes = st.integers(1, 6)


@settings(max_examples=300, deadline=None)
@given(tokens, tokens, sizes)
def test_equal_hash_exactly_when_leading_blocks_equal(
    a: list[int], b: list[int], size: int
) -> None:
    ha, hb = block_hashes(a, size), block_hashes(b, size)
    assert len(ha) == len(a) // size
    for i in range(min(len(ha), len(hb))):
        same_blocks = a[: (i + 1) * size] == b[: (i + 1) * size]
        assert (ha[i] == hb[i]) == same_blocks


@settings(max_examples=200, deadline=None)
@given(tokens, tokens, sizes)
def test_prefix_stable(a: list[int], extra: list[int], size: int) -> None:
    ha = block_hashes(a, size)
    assert block_hashes(a + extra, size)[: len(ha)] == ha
    assert all(0 <= h < 2**64 for h in ha)


@settings(max_examples=200, deadline=None)
@given(tokens, sizes, st.integers(1, 4))
def test_prefix_key_is_the_hash_of_the_first_blocks(seq: list[int], size: int, count: int) -> None:
    hashes = block_hashes(seq, size)
    key = prefix_key(seq, block_size=size, num_blocks=count)
    if not hashes:
        assert key is None
    else:
        assert key == hashes[min(count, len(hashes)) - 1]


@settings(max_examples=200, deadline=None)
@given(tokens, tokens, sizes, st.integers(1, 3))
def test_rows_sharing_enough_tokens_share_a_key(
    shared: list[int], rest: list[int], size: int, count: int
) -> None:
    need = size * count
    if len(shared) < need:
        shared = shared + [0] * (need - len(shared))
    assert prefix_key(shared, size, count) == prefix_key(shared + rest, size, count)


def test_hash_bytes_are_fixed_and_arrays_match_lists() -> None:
    seq = [1, 2, 3, 70000, 5, 6, 7]
    first = hashlib.blake2b(bytes(8) + np.asarray([1, 2, 3], "<i4").tobytes(), digest_size=8)
    second = hashlib.blake2b(
        first.digest() + np.asarray([70000, 5, 6], "<i4").tobytes(), digest_size=8
    )
    expected = [int.from_bytes(first.digest(), "little"), int.from_bytes(second.digest(), "little")]
    assert block_hashes(seq, 3) == expected
    assert block_hashes(np.asarray(seq, dtype=np.int64), 3) == expected
    assert block_hashes(np.asarray(seq, dtype=np.uint32), 3) == expected
    assert prefix_key([1, 2], block_size=3) is None
    assert block_hashes([], 4) == []


def test_same_hashes_in_another_process() -> None:
    # Python's hash() is salted per process; ours must not be.
    code = "from packing.keys import block_hashes; print(block_hashes(list(range(10)), 4))"
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert other.strip() == str(block_hashes(list(range(10)), 4))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: block_hashes([1, 2], 0), "block_size must be a positive integer, got 0"),
        (lambda: block_hashes([1, 2], 2.0), r"block_size must be a positive integer, got 2.0"),
        (lambda: block_hashes([1, -2], 2), "token ids must be in 0..2147483647, got -2"),
        (lambda: block_hashes([1, 2**31], 2), "got 2147483648 at position 1"),
        (lambda: block_hashes([1, 2**70], 2), "outside 0..2147483647"),
        (lambda: block_hashes([1, "a"], 2), r"tokens\[1\] must be an integer token id, got 'a'"),
        (lambda: block_hashes("ab", 2), "tokens must be a sequence of integer token ids"),
        (lambda: block_hashes(np.ones(3), 2), "1-D sequence of integer token ids"),
        (lambda: prefix_key([1, 2], 2, 0), "num_blocks must be a positive integer, got 0"),
        (lambda: prefix_key([1, 2], -1), "block_size must be a positive integer, got -1"),
    ],
)
def test_bad_input_is_a_value_error(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]
