"""The whole step in one flash varlen call per layer (`torch.nn.attention.varlen`, CUDA in
bfloat16 / float16: flash has no float32 kernel and no CPU one).

A sliding window is flash's own `window_size=(window - 1, 0)` (bottom-right aligned, as
transformers' flash path passes it: a query sees itself and window - 1 keys before it).
torch's varlen has no softcap, so a softcapped layer (Gemma 2) attends request by request
through `dense.attend` instead, over the same gathered keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from actors.attention.base import AttentionBackend, LayerAttention, StepBatch, device_tensor
from actors.attention.dense import attend, segment_mask
from packing.layout import token_slots


@dataclass(frozen=True)
class VarlenInputs:
    """Cached + new keys of every request of the batch, end to end."""

    rows: slice  # the batch's rows in the step's flat sequence
    key_slots: torch.Tensor  # [total_keys] cache slots, request after request
    cu_seqlens_q: torch.Tensor  # [num_reqs + 1] int32, from 0
    cu_seqlens_k: torch.Tensor  # [num_reqs + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    num_new: tuple[int, ...]  # per request, for the softcapped layers' request-by-request path
    num_keys: tuple[int, ...]


class VarlenBackend(AttentionBackend[VarlenInputs]):
    """Decodes, chunks and prompts alike: each request's keys gathered from the cache, one
    `varlen_attn` call. Its causal mask is aligned bottom-right, as cached prefixes need."""

    def prepare(self, batch: StepBatch) -> VarlenInputs:
        """Key slots and cu_seqlens of the batch's requests."""
        num_keys = batch.num_cached + batch.num_new
        key_slots = np.concatenate(
            [
                token_slots(table, int(n), batch.block_size)
                for table, n in zip(batch.block_tables, num_keys, strict=True)
            ]
        )
        cu_q = batch.cu_seqlens_q - batch.cu_seqlens_q[0]
        cu_k = np.concatenate([[0], np.cumsum(num_keys)])
        return VarlenInputs(
            rows=batch.rows,
            key_slots=device_tensor(key_slots, self.device),
            cu_seqlens_q=device_tensor(cu_q.astype(np.int32), self.device),
            cu_seqlens_k=device_tensor(cu_k.astype(np.int32), self.device),
            max_seqlen_q=int(batch.num_new.max()),
            max_seqlen_k=int(num_keys.max()),
            num_new=tuple(int(n) for n in batch.num_new),
            num_keys=tuple(int(n) for n in num_keys),
        )

    def forward(
        self,
        meta: VarlenInputs,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        params: LayerAttention,
        out: torch.Tensor,
    ) -> None:
        """Gather the keys, one varlen call (request by request in a softcapped layer)."""
        from torch.nn.attention.varlen import varlen_attn

        k_cache, v_cache = self.kv_caches[layer]  # [num_blocks, block_size, kv_heads, dim]
        _, _, kv_heads, dim = k_cache.shape
        k = k_cache.view(-1, kv_heads, dim).index_select(0, meta.key_slots)  # [keys, kv, dim]
        v = v_cache.view(-1, kv_heads, dim).index_select(0, meta.key_slots)
        q = query[0, :, meta.rows].transpose(0, 1).contiguous()  # [tokens, heads, dim]
        if params.softcap is not None:
            out[meta.rows] = _softcapped(meta, q, k, v, params)
            return
        left = -1 if params.window is None else params.window - 1
        attended = varlen_attn(
            q,
            k,
            v,
            meta.cu_seqlens_q,
            meta.cu_seqlens_k,
            meta.max_seqlen_q,
            meta.max_seqlen_k,
            scale=params.scale,
            window_size=(left, 0),
            enable_gqa=True,
        )
        assert isinstance(attended, torch.Tensor)  # no log-sum-exp asked for
        out[meta.rows] = attended


def _softcapped(
    meta: VarlenInputs,
    q: torch.Tensor,  # [tokens, heads, dim]
    k: torch.Tensor,  # [keys, kv_heads, dim], request after request
    v: torch.Tensor,
    params: LayerAttention,
) -> torch.Tensor:
    """`[tokens, heads, dim]`: each request's rows against its keys, eagerly."""
    out = torch.empty_like(q)
    q_start = k_start = 0
    for new, keys in zip(meta.num_new, meta.num_keys, strict=True):
        cached = keys - new
        mask = segment_mask(cached, new, 0, params.window, q.device)
        rows = slice(q_start, q_start + new)
        k_req = k[k_start : k_start + keys].transpose(0, 1).unsqueeze(0)  # [1, kv, keys, dim]
        v_req = v[k_start : k_start + keys].transpose(0, 1).unsqueeze(0)
        o = attend(q[rows].transpose(0, 1).unsqueeze(0), k_req, v_req, mask, params)
        out[rows] = o[0].transpose(0, 1)
        q_start, k_start = q_start + new, k_start + keys
    return out
