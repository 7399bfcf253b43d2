"""One mixed step for attention-backend tests: three decodes (one whose new token opens a
block), a cached prefix extended by a chunk, and a fresh prompt, over blocks in a shuffled
order; and its first-principles answer (each request alone, one SDPA over its keys, or the
eager softmax of Hugging Face's Gemma 2 with a sliding window and a logit softcap)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from actors.attention import AttentionBackend, AttentionMetadata, StepBatch, paged_attention
from packing.layout import flat_layout, slot_mapping, token_slots

BLOCK_SIZE = 16
SCALE = 0.125
NUM_CACHED = np.array([20, 33, 16, 16, 0])  # decodes first
NUM_NEW = np.array([1, 1, 1, 9, 17])
NUM_DECODES = 3
BLOCKS = [[9, 1], [4, 0, 7], [2, 10], [5, 3], [8, 6]]  # each request's block table


class Layer(torch.nn.Module):
    """What transformers passes as `module`: only its layer_idx is read."""

    layer_idx = 1


@dataclass(frozen=True)
class Step:
    """The step's new q/k/v (transformers' layout) and two layers of random cache."""

    q: torch.Tensor  # [1, heads, tokens, dim]
    k: torch.Tensor  # [1, kv_heads, tokens, dim]
    v: torch.Tensor
    caches: list[tuple[torch.Tensor, torch.Tensor]]  # [blocks, block_size, kv_heads, dim]


def make_step(heads: int = 6, kv_heads: int = 2, dim: int = 64, seed: int = 0) -> Step:
    gen = torch.Generator().manual_seed(seed)
    tokens = int(NUM_NEW.sum())

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    caches = [(randn(11, BLOCK_SIZE, kv_heads, dim), randn(11, BLOCK_SIZE, kv_heads, dim))]
    caches.append((randn(11, BLOCK_SIZE, kv_heads, dim), randn(11, BLOCK_SIZE, kv_heads, dim)))
    q, k, v = (
        randn(1, heads, tokens, dim),
        randn(1, kv_heads, tokens, dim),
        randn(1, kv_heads, tokens, dim),
    )
    return Step(q, k, v, caches)


def batch() -> StepBatch:
    return StepBatch(
        NUM_CACHED,
        NUM_NEW,
        BLOCKS,
        flat_layout(NUM_CACHED, NUM_NEW).cu_seqlens_q,
        NUM_DECODES,
        BLOCK_SIZE,
    )


def attend(
    make: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], AttentionBackend[Any]],
    step: Step,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    **layer: Any,
) -> torch.Tensor:
    """The step through `paged_attention` with the backend `make` builds over a copy of the
    caches; `[tokens, heads, dim]` in float32 on CPU. `layer`: the keywords transformers
    passes a layer's attention (`sliding_window`, `softcap`)."""
    caches = [(k.to(device, dtype).clone(), v.to(device, dtype).clone()) for k, v in step.caches]
    backend = make(caches)
    slots = slot_mapping(NUM_CACHED, NUM_NEW, BLOCKS, BLOCK_SIZE)
    meta = AttentionMetadata.build(backend, batch(), slots)
    q, k, v = (t.to(device, dtype) for t in (step.q, step.k, step.v))
    out, _ = paged_attention(Layer(), q, k, v, None, scaling=SCALE, raypack_attention=meta, **layer)
    return out[0].float().cpu()


def reference(step: Step, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Each request alone: its cached keys (read from the cache as it was) then its new
    ones, causal with the new rows aligned at the end (and, given a window or a softcap,
    Hugging Face's eager attention with them: `reference_eager`)."""
    k_cache, v_cache = step.caches[Layer.layer_idx]
    _, _, kv_heads, dim = k_cache.shape
    rows = np.concatenate([[0], np.cumsum(NUM_NEW)])
    out = torch.empty(rows[-1], step.q.shape[1], dim)
    for i, (cached, new) in enumerate(zip(NUM_CACHED, NUM_NEW, strict=True)):
        lo, hi = rows[i], rows[i + 1]
        slots = torch.from_numpy(token_slots(BLOCKS[i], int(cached), BLOCK_SIZE))
        # [cached + new, kv_heads, dim]
        k = torch.cat([k_cache.view(-1, kv_heads, dim)[slots], step.k[0, :, lo:hi].transpose(0, 1)])
        v = torch.cat([v_cache.view(-1, kv_heads, dim)[slots], step.v[0, :, lo:hi].transpose(0, 1)])
        mask = torch.arange(cached + new)[None, :] <= cached + torch.arange(new)[:, None]
        if window is not None or softcap is not None:
            positions = cached + torch.arange(new)
            out[lo:hi] = reference_eager(step.q[0, :, lo:hi], k, v, positions, window, softcap)
            continue
        o = F.scaled_dot_product_attention(
            step.q[0, :, lo:hi],
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            scale=SCALE,
            enable_gqa=True,
        )  # [heads, new, dim]
        out[lo:hi] = o.transpose(0, 1)
    return out


def reference_eager(
    q: torch.Tensor,  # [heads, new, dim]
    k: torch.Tensor,  # [keys, kv_heads, dim], positions 0 ..
    v: torch.Tensor,
    positions: torch.Tensor,  # [new] the queries' positions
    window: int | None,
    softcap: float | None,
    scale: float = SCALE,
) -> torch.Tensor:
    """`[new, heads, dim]`: transformers' Gemma 2 `eager_attention_forward` (scale, softcap,
    mask, float32 softmax) under its `sliding_window_causal_mask_function` (a query at p
    sees keys at positions k with p - window < k <= p), written out key by key."""
    heads, kv_heads = q.shape[0], k.shape[1]
    keys = k.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # [heads, keys, dim]
    values = v.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    scores = q @ keys.transpose(1, 2) * scale  # [heads, new, keys]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    for row, p in enumerate(positions.tolist()):
        for key in range(k.shape[0]):
            if key > p or (window is not None and not key > p - window):
                scores[:, row, key] = float("-inf")
    return (torch.softmax(scores.float(), dim=-1) @ values).transpose(0, 1)


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
    """`varlen_attn`'s semantics in plain torch (a CPU stand-in): causal masks aligned
    bottom-right, and flash's sliding window `(left, 0)`: a query sees `left` keys before
    its own."""
    left, right = window_size
    assert right == 0 and enable_gqa
    out = torch.empty_like(q)  # [tokens, heads, dim]
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        rows = (ke - ks) - (qe - qs) + torch.arange(qe - qs)
        mask = torch.arange(ke - ks)[None, :] <= rows[:, None]
        if left >= 0:
            mask &= torch.arange(ke - ks)[None, :] >= rows[:, None] - left
        o = torch.nn.functional.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1),
            k[ks:ke].transpose(0, 1),
            v[ks:ke].transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[qs:qe] = o.transpose(0, 1)
    return out
