"""Layouts of packed model inputs as numpy arrays (no torch).

A step of the engine is one flat sequence: each request contributes a segment of `num_new`
tokens that continue after its `num_cached` tokens already in the KV cache. These helpers turn
segments into the arrays a varlen attention kernel and a paged KV cache need:

- positions that restart for each request and continue after its cached tokens,
- `cu_seqlens_q` / `cu_seqlens_k`: cumulative query and key extents,
- the slot mapping (where each new token's K/V goes in a paged cache, given block tables),
- the Prepacking 2-D layout's block-diagonal causal mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class FlatLayout:
    """Positions and query/key extents of a flat (varlen) step.

    Request i's queries are rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]` of the flat sequence; its
    keys are its `num_cached + num_new` tokens, `cu_seqlens_k[i]:cu_seqlens_k[i+1]` when the
    keys of all requests are laid end to end.
    """

    positions: IntArray  # [num_tokens]
    cu_seqlens_q: IntArray  # [num_reqs + 1]
    cu_seqlens_k: IntArray  # [num_reqs + 1]
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def num_tokens(self) -> int:
        """Tokens in the flat sequence (sum of num_new)."""
        return int(self.cu_seqlens_q[-1])

    @property
    def last_token_indices(self) -> IntArray:
        """Row of each request's last new token in the flat sequence. # [num_reqs]"""
        return self.cu_seqlens_q[1:] - 1


def _as_counts(name: str, values: Sequence[int] | IntArray) -> IntArray:
    array = np.asarray(values, dtype=np.int64).reshape(-1)
    if array.size and int(array.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got {array.tolist()}")
    return array


def cu_seqlens(lengths: Sequence[int] | IntArray) -> IntArray:
    """Cumulative extents `[0, l0, l0+l1, ...]` of consecutive segments. # [n + 1]"""
    counts = _as_counts("lengths", lengths)
    out = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def segment_ids(lengths: Sequence[int] | IntArray) -> IntArray:
    """The segment index of every row: `[0]*l0 + [1]*l1 + ...`. # [sum(lengths)]"""
    counts = _as_counts("lengths", lengths)
    return np.repeat(np.arange(counts.size, dtype=np.int64), counts)


def flat_layout(
    num_cached: Sequence[int] | IntArray, num_new: Sequence[int] | IntArray
) -> FlatLayout:
    """The flat layout of segments `(num_cached[i], num_new[i])`.

    Positions of segment i run `num_cached[i] .. num_cached[i] + num_new[i] - 1`.
    """
    cached = _as_counts("num_cached", num_cached)
    new = _as_counts("num_new", num_new)
    if cached.shape != new.shape:
        raise ValueError(
            f"num_cached and num_new must have the same length, got {cached.size} and {new.size}"
        )
    cu_q = cu_seqlens(new)
    cu_k = cu_seqlens(cached + new)
    rows = np.arange(int(cu_q[-1]), dtype=np.int64)
    # Each row's offset inside its segment, shifted by the segment's cached tokens.
    positions = rows - np.repeat(cu_q[:-1] - cached, new)
    return FlatLayout(
        positions=positions,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=int(new.max()) if new.size else 0,
        max_seqlen_k=int((cached + new).max()) if new.size else 0,
    )


def padded_block_tables(block_tables: Sequence[Sequence[int]], pad: int = 0) -> IntArray:
    """Ragged block tables as one `[num_reqs, max_blocks]` array, padded with `pad`."""
    width = max((len(table) for table in block_tables), default=0)
    out = np.full((len(block_tables), width), pad, dtype=np.int64)
    for i, table in enumerate(block_tables):
        out[i, : len(table)] = table
    return out


def slot_mapping(
    num_cached: Sequence[int] | IntArray,
    num_new: Sequence[int] | IntArray,
    block_tables: Sequence[Sequence[int]],
    block_size: int,
) -> IntArray:
    """Cache slot (`block_id * block_size + offset`) of every new token. # [num_tokens]

    Token at position p of request i lives in block `block_tables[i][p // block_size]`.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    layout = flat_layout(num_cached, num_new)
    new = _as_counts("num_new", num_new)
    if len(block_tables) != new.size:
        raise ValueError(
            f"need one block table per segment: {new.size} segments, {len(block_tables)} tables"
        )
    cached = _as_counts("num_cached", num_cached)
    for i, table in enumerate(block_tables):
        needed = -(-int(cached[i] + new[i]) // block_size)
        if len(table) < needed:
            raise ValueError(
                f"block table {i} has {len(table)} blocks, needs {needed} for "
                f"{int(cached[i] + new[i])} tokens of block size {block_size}"
            )
    tables = padded_block_tables(block_tables)
    seg = segment_ids(new)
    blocks = tables[seg, layout.positions // block_size]
    return blocks * block_size + layout.positions % block_size


def token_slots(block_table: Sequence[int], num_tokens: int, block_size: int) -> IntArray:
    """Cache slots of positions `0 .. num_tokens - 1` of one request. # [num_tokens]"""
    positions = np.arange(num_tokens, dtype=np.int64)
    table = np.asarray(block_table, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size


def block_diagonal_causal_mask(lengths: Sequence[int] | IntArray) -> BoolArray:
    """Prepacking's mask for prompts packed in one row: True where a query may attend a key.

    Row r attends key c when both are in the same prompt and c <= r. # [total, total]
    """
    seg = segment_ids(lengths)
    rows = np.arange(seg.size)
    same = seg[:, None] == seg[None, :]
    causal = rows[None, :] <= rows[:, None]
    result: BoolArray = same & causal
    return result


def restart_positions(lengths: Sequence[int] | IntArray) -> IntArray:
    """Positions restarting at 0 for each packed prompt. # [sum(lengths)]"""
    counts = _as_counts("lengths", lengths)
    return flat_layout(np.zeros_like(counts), counts).positions
