"""Decodes through the compiled paged decode kernel (`actors.kernels`, float32 or bfloat16 on
CPU)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from actors.attention.base import (
    AttentionBackend,
    KVCaches,
    LayerAttention,
    StepBatch,
    device_tensor,
)
from actors.kernels import PagedDecode, check_cache, check_step
from packing.layout import padded_block_tables


@dataclass(frozen=True)
class KernelDecodes:
    """`KernelDecodeBackend`'s metadata: the step's decodes, rows `first_row ..` in order."""

    first_row: int
    block_tables: torch.Tensor  # [n, max_blocks] int64, padded
    seq_lens: torch.Tensor  # [n] int64: cached keys + the new one


class KernelDecodeBackend(AttentionBackend[KernelDecodes]):
    """All decodes of a step in one kernel call per layer: the kernel reads each sequence's
    keys straight from its blocks (no gathered copy), over torch's threads.

    What the kernel needs is checked as early as it can be, not per layer: the caches when
    the backend is built, the step's tables in `prepare`; per layer only the query is made
    contiguous (the caches' dtype: the model's, float32 or bfloat16)."""

    def __init__(self, kv_caches: KVCaches, kernel: PagedDecode) -> None:
        super().__init__(kv_caches)
        for k_cache, v_cache in kv_caches:
            if k_cache.numel():  # a pipeline stage's other layers are empty
                check_cache(k_cache, v_cache, kernel.dtype)
        self.kernel = kernel

    def prepare(self, batch: StepBatch) -> KernelDecodes:
        """Padded block tables and key counts of the batch's decodes."""
        assert batch.num_decodes == batch.num_reqs, "KernelDecodeBackend attends decodes only"
        tables = device_tensor(padded_block_tables(batch.block_tables), self.device)
        seq_lens = device_tensor(batch.num_cached.astype(np.int64) + 1, self.device)
        check_step(tables, seq_lens)
        return KernelDecodes(int(batch.cu_seqlens_q[0]), tables, seq_lens)

    def forward(
        self,
        meta: KernelDecodes,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        params: LayerAttention,
        out: torch.Tensor,
    ) -> None:
        """One kernel call for every decode row (each attends to its window's keys only)."""
        k_cache, v_cache = self.kv_caches[layer]
        rows = slice(meta.first_row, meta.first_row + len(meta.seq_lens))
        q = query[0, :, rows].transpose(0, 1).contiguous()  # [n, heads, dim]
        self.kernel.run(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            params.scale,
            out[rows],
            window=params.window,
            softcap=params.softcap,
        )
