"""The whole step in one flash varlen call per layer (`torch.nn.attention.varlen`, CUDA in
bfloat16 / float16: flash has no float32 kernel and no CPU one)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from actors.attention.base import AttentionBackend, StepBatch, device_tensor
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
        )

    def forward(
        self,
        meta: VarlenInputs,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float | None,
        out: torch.Tensor,
    ) -> None:
        """Gather the keys, one varlen call."""
        from torch.nn.attention.varlen import varlen_attn

        k_cache, v_cache = self.kv_caches[layer]  # [num_blocks, block_size, kv_heads, dim]
        _, _, kv_heads, dim = k_cache.shape
        k = k_cache.view(-1, kv_heads, dim).index_select(0, meta.key_slots)  # [keys, kv, dim]
        v = v_cache.view(-1, kv_heads, dim).index_select(0, meta.key_slots)
        q = query[0, :, meta.rows].transpose(0, 1).contiguous()  # [tokens, heads, dim]
        attended = varlen_attn(
            q,
            k,
            v,
            meta.cu_seqlens_q,
            meta.cu_seqlens_k,
            meta.max_seqlen_q,
            meta.max_seqlen_k,
            scale=scaling,
            window_size=(-1, 0),
            enable_gqa=True,
        )
        assert isinstance(attended, torch.Tensor)  # no log-sum-exp asked for
        out[meta.rows] = attended
