"""Property tests of packing.layout against direct, loop-by-loop constructions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packing.layout import (
    block_diagonal_causal_mask,
    cu_seqlens,
    flat_layout,
    padded_block_tables,
    restart_positions,
    segment_ids,
    slot_mapping,
    token_slots,
)

segments = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 20)), min_size=0, max_size=12)


@given(segments)
def test_flat_layout_matches_direct_construction(segs: list[tuple[int, int]]) -> None:
    cached = [c for c, _ in segs]
    new = [n for _, n in segs]
    layout = flat_layout(cached, new)
    positions: list[int] = []
    cu_q, cu_k = [0], [0]
    for c, n in segs:
        positions.extend(range(c, c + n))
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + c + n)
    assert layout.positions.tolist() == positions
    assert layout.cu_seqlens_q.tolist() == cu_q
    assert layout.cu_seqlens_k.tolist() == cu_k
    assert layout.num_tokens == sum(new)
    assert layout.max_seqlen_q == max(new, default=0)
    assert layout.max_seqlen_k == max((c + n for c, n in segs), default=0)
    assert layout.last_token_indices.tolist() == [x - 1 for x in cu_q[1:]]


@given(st.data(), segments, st.integers(1, 8))
def test_slot_mapping_matches_direct_construction(
    data: st.DataObject, segs: list[tuple[int, int]], block_size: int
) -> None:
    tables: list[list[int]] = []
    for c, n in segs:
        needed = -(-(c + n) // block_size)
        ids = data.draw(st.lists(st.integers(0, 500), min_size=needed, max_size=needed + 2))
        tables.append(ids)
    slots = slot_mapping([c for c, _ in segs], [n for _, n in segs], tables, block_size)
    expected = [
        tables[i][p // block_size] * block_size + p % block_size
        for i, (c, n) in enumerate(segs)
        for p in range(c, c + n)
    ]
    assert slots.tolist() == expected
    for i, (c, n) in enumerate(segs):
        direct = [tables[i][p // block_size] * block_size + p % block_size for p in range(c + n)]
        assert token_slots(tables[i], c + n, block_size).tolist() == direct


@given(st.lists(st.integers(0, 15), max_size=10))
@settings(max_examples=60)
def test_block_diagonal_causal_mask_matches_direct_construction(lengths: list[int]) -> None:
    mask = block_diagonal_causal_mask(lengths)
    total = sum(lengths)
    expected = np.zeros((total, total), dtype=bool)
    start = 0
    for n in lengths:
        for r in range(n):
            for c in range(r + 1):
                expected[start + r, start + c] = True
        start += n
    assert mask.dtype == np.bool_
    assert np.array_equal(mask, expected)
    assert restart_positions(lengths).tolist() == [p for n in lengths for p in range(n)]
    assert segment_ids(lengths).tolist() == [i for i, n in enumerate(lengths) for _ in range(n)]
    assert cu_seqlens(lengths).tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]


def test_padded_block_tables() -> None:
    assert padded_block_tables([[3, 4], [], [7]], pad=-1).tolist() == [[3, 4], [-1, -1], [7, -1]]
    assert padded_block_tables([]).shape == (0, 0)


def test_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="num_new"):
        flat_layout([0], [-1])
    with pytest.raises(ValueError, match="same length"):
        flat_layout([0, 1], [1])
    with pytest.raises(ValueError, match="block table 0 has 1 blocks, needs 2"):
        slot_mapping([3], [2], [[0]], 4)
    with pytest.raises(ValueError, match="block_size"):
        slot_mapping([0], [1], [[0]], 0)
