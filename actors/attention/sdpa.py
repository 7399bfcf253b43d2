"""torch SDPA backends, on any device: decodes gathered by block table into padded chunks
(`SdpaDecodeBackend`), and one SDPA call per request for everything else
(`SdpaPrefillBackend`). A layer's sliding window is a mask (and, for a request's rows, the
keys before any row's window are not read); a softcapped layer runs the eager computation
(`dense.attend`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from actors.attention.base import AttentionBackend, LayerAttention, StepBatch, device_tensor
from actors.attention.dense import attend, segment_mask, visible
from packing.layout import padded_block_tables, token_slots

DECODE_CHUNK = 16  # decodes attended per SDPA call


@dataclass(frozen=True)
class DecodeChunk:
    """Decodes of similar context length, attended together with their K/V gathered into
    one padded batch."""

    rows: torch.Tensor  # [n] their rows in the step's flat sequence
    block_ids: torch.Tensor  # [n * max_blocks] padded block tables, flattened
    key_mask: torch.Tensor  # [n, 1, 1, max_blocks * block_size] True where a key exists
    last_pos: torch.Tensor  # [n, 1, 1, 1] each decode's position (its keys - 1)
    max_blocks: int


@dataclass(frozen=True)
class GatheredDecodes:
    """`SdpaDecodeBackend`'s metadata for one step."""

    chunks: tuple[DecodeChunk, ...]
    # [2, max chunk blocks, block_size, kv_heads, dim]: the chunks' gathered K and V, reused
    # by every chunk and layer of the step instead of two fresh tensors per chunk and layer
    gather_buffer: torch.Tensor


class SdpaDecodeBackend(AttentionBackend[GatheredDecodes]):
    """Decodes in chunks of `DECODE_CHUNK`, grouped by context length so a chunk pads little;
    each chunk's K/V gathered by block table into one reused buffer and attended by one SDPA
    call with a key mask. Runs wherever torch does (a GPU without flash kernels, a CPU with
    no C compiler); slower than the C kernel on CPU, the same tokens."""

    def prepare(self, batch: StepBatch) -> GatheredDecodes:
        """Chunks of the batch's decodes, shortest contexts first."""
        assert batch.num_decodes == batch.num_reqs, "SdpaDecodeBackend attends decodes only"
        first_row = int(batch.cu_seqlens_q[0])
        block_size = batch.block_size
        # Chunks of a few requests: each chunk's gathered K/V stays in the CPU cache while
        # SDPA reads it, and pads only to its own longest request (measured ~1.5x faster than
        # one padded batch of 256 decodes). Sorting by context length first makes the chunks'
        # lengths alike (~15% less decode attention time on Alpaca prompts than in running
        # order).
        by_length = np.argsort(batch.num_cached, kind="stable")
        chunks = []
        for start in range(0, batch.num_reqs, DECODE_CHUNK):
            members = by_length[start : start + DECODE_CHUNK]
            tables = padded_block_tables([batch.block_tables[i] for i in members])
            max_blocks = tables.shape[1]  # tables: [n, max_blocks]
            seq_lens = batch.num_cached[members] + 1  # [n]
            keys = np.arange(max_blocks * block_size)
            key_mask = keys[None, :] < seq_lens[:, None]  # [n, max_blocks * block_size]
            chunks.append(
                DecodeChunk(
                    rows=device_tensor(first_row + members, self.device),
                    block_ids=device_tensor(tables.reshape(-1), self.device),
                    key_mask=device_tensor(key_mask[:, None, None, :], self.device),
                    last_pos=device_tensor(seq_lens[:, None, None, None] - 1, self.device),
                    max_blocks=max_blocks,
                )
            )
        most = max(len(c.block_ids) for c in chunks)
        buffer = torch.empty(2, most, *self.cache_shape[1:], dtype=self.dtype, device=self.device)
        return GatheredDecodes(tuple(chunks), buffer)

    def forward(
        self,
        meta: GatheredDecodes,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        params: LayerAttention,
        out: torch.Tensor,
    ) -> None:
        """Gather each chunk's blocks into the buffer, one masked SDPA call per chunk."""
        k_cache, v_cache = self.kv_caches[layer]  # [num_blocks, block_size, kv_heads, dim]
        _, block_size, kv_heads, head_dim = k_cache.shape
        by_token = query[0].transpose(0, 1)  # [tokens, heads, dim]
        for chunk in meta.chunks:
            n, seq, num = len(chunk.rows), chunk.max_blocks * block_size, len(chunk.block_ids)
            q = by_token.index_select(0, chunk.rows).unsqueeze(2)  # [n, heads, 1, dim]
            k_buf, v_buf = meta.gather_buffer[0, :num], meta.gather_buffer[1, :num]
            k = torch.index_select(k_cache, 0, chunk.block_ids, out=k_buf)
            v = torch.index_select(v_cache, 0, chunk.block_ids, out=v_buf)
            k = k.view(n, seq, kv_heads, head_dim)  # -> [n, kv_heads, keys, dim] below
            v = v.view(n, seq, kv_heads, head_dim)
            mask = chunk.key_mask
            if params.window is not None:  # keys in the window of each decode's position
                keys = torch.arange(seq, device=self.device)
                mask = visible(chunk.last_pos, keys, params.window)  # [n, 1, 1, seq]
            o = attend(q, k.transpose(1, 2), v.transpose(1, 2), mask, params)  # [n, heads, 1, dim]
            out.index_copy_(0, chunk.rows, o.squeeze(2))


@dataclass(frozen=True)
class PrefillSegment:
    """One request's rows, attended by one SDPA call."""

    q_start: int  # its rows in the flat sequence: q_start .. q_end - 1
    q_end: int
    num_cached: int  # the position of its first row
    key_slots: torch.Tensor | None  # [num_cached + num_new] cache slots; None: fresh K/V only
    mask: torch.Tensor | None  # [num_new, num_cached + num_new] bottom-right causal, or None


class SdpaPrefillBackend(AttentionBackend[tuple[PrefillSegment, ...]]):
    """One SDPA call per request: `is_causal` on the fresh K/V when nothing is cached, else
    its cached and new K/V read back from the cache with a bottom-right causal mask. Looping
    over requests beats one dense block-diagonal mask ~10x on CPU (measured on 16 prompts of
    4,598 tokens: 18.6 ms against 176 ms)."""

    def prepare(self, batch: StepBatch) -> tuple[PrefillSegment, ...]:
        """One segment per request (a decode is a segment of one row)."""
        segments = []
        for i in range(batch.num_reqs):
            cached, new = int(batch.num_cached[i]), int(batch.num_new[i])
            key_slots, mask = None, None
            if cached:
                slots = token_slots(batch.block_tables[i], cached + new, batch.block_size)
                key_slots = device_tensor(slots, self.device)
                if new > 1:
                    rows = cached + np.arange(new)
                    mask = device_tensor(
                        np.arange(cached + new)[None, :] <= rows[:, None], self.device
                    )
            start = int(batch.cu_seqlens_q[i])
            segments.append(PrefillSegment(start, start + new, cached, key_slots, mask))
        return tuple(segments)

    def forward(
        self,
        meta: tuple[PrefillSegment, ...],
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        params: LayerAttention,
        out: torch.Tensor,
    ) -> None:
        """One SDPA call per segment; in a sliding-window layer whose window a segment
        outgrows, from its first row's first key on, with the band mask."""
        k_cache, v_cache = self.kv_caches[layer]
        _, _, kv_heads, head_dim = k_cache.shape
        k_flat = k_cache.view(-1, kv_heads, head_dim)
        v_flat = v_cache.view(-1, kv_heads, head_dim)
        for seg in meta:
            q = query[:, :, seg.q_start : seg.q_end]  # [1, heads, n, dim]
            n = seg.q_end - seg.q_start
            mask, first = seg.mask, 0
            windowed = params.window is not None and seg.num_cached + n > params.window
            if windowed:  # no earlier key is in any row's window
                first = params.first_key(seg.num_cached)
                mask = segment_mask(seg.num_cached, n, first, params.window, q.device)
            if seg.key_slots is None:  # nothing cached: causal attention on the fresh K/V
                k = key[:, :, seg.q_start : seg.q_end]
                v = value[:, :, seg.q_start : seg.q_end]
            else:  # [1, kv_heads, cached + n - first, dim] read back from the cache
                slots = seg.key_slots[first:]
                k = k_flat.index_select(0, slots).transpose(0, 1).unsqueeze(0)
                v = v_flat.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            causal = not windowed and seg.key_slots is None and n > 1
            o = attend(q, k, v, mask, params, causal)  # [1, heads, n, dim]
            out[seg.q_start : seg.q_end] = o[0].transpose(0, 1)
