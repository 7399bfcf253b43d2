"""Prefill attention by oneDNN matrix products, for float32 on CPU (`GemmPrefillBackend`).

Why by hand: torch's CPU flash kernel (what SDPA runs on CPU) does its float32 products
through MKL, which on AMD CPUs takes its AVX2 path (see `actors.cpu_linear`), in tiles of a
few dozen rows: measured ~90-170 GFLOP/s on a 2-core AMD EPYC at the prefix set's shapes (a
512-row chunk against ~1,080 cached and new keys: 7.8 ms a layer). Here a segment's
attention is two oneDNN products per kv head (`torch.ops.mkldnn._linear_pointwise`, the op
the model's linears run on): the kv head's query heads stacked as rows (GQA) times its keys,
the causal mask added and the softmax taken in float32, then times its values (4.7 ms at that
shape). The whole rectangle of the segment's new keys is computed (the causal half above the
diagonal masked), which the faster products more than pay for at >= `MIN_ROWS` rows; shorter
segments (a question's few tokens, a decode) stay on SDPA, where the call overhead is less.

The same softmax over the same keys, its sums in another order: equal to SDPA's to float32
rounding (tests/actors/test_gemm_prefill.py). Layers with a logit softcap, and sliding
windows that a segment outgrows, take `SdpaPrefillBackend`'s path.
"""

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
from actors.attention.sdpa import PrefillSegment, SdpaPrefillBackend

MIN_ROWS = 64  # new rows from which a segment runs as matrix products (measured: 124 rows
# against ~1,000 keys 1.6 ms against SDPA's 2.5 ms; 22 rows 0.6-0.8 ms against 0.5 ms)


@dataclass(frozen=True)
class GemmSegment:
    """A segment attended by matrix products: its `PrefillSegment` and its additive mask
    `[num_new, keys]` (0 where a row sees a key, -inf elsewhere: bottom-right causal)."""

    segment: PrefillSegment
    bias: torch.Tensor


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b.T` for 2-D float32 `a` `[m, k]` and contiguous `b` `[n, k]`, by oneDNN."""
    product: torch.Tensor = torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
    return product


Prepared = tuple[PrefillSegment | GemmSegment, ...]


class GemmPrefillBackend(AttentionBackend[Prepared]):
    """`SdpaPrefillBackend`'s segments, those of >= `min_rows` new rows attended by oneDNN
    matrix products (see the module's docstring); float32 caches on CPU only."""

    def __init__(self, kv_caches: KVCaches, min_rows: int = MIN_ROWS) -> None:
        super().__init__(kv_caches)
        self.sdpa = SdpaPrefillBackend(kv_caches)
        if self.device.type != "cpu" or self.dtype != torch.float32:
            raise ValueError(f"GemmPrefillBackend needs float32 on CPU, got {self.dtype}")
        self.min_rows = min_rows

    def prepare(self, batch: StepBatch) -> Prepared:
        """SDPA's segments, those of >= `min_rows` rows with their additive masks."""
        segments: list[PrefillSegment | GemmSegment] = []
        for seg in self.sdpa.prepare(batch):
            n = seg.q_end - seg.q_start
            if n < self.min_rows:
                segments.append(seg)
                continue
            rows = seg.num_cached + np.arange(n)
            seen = np.arange(seg.num_cached + n)[None, :] <= rows[:, None]
            bias = np.where(seen, np.float32(0), np.float32(-np.inf)).astype(np.float32)
            segments.append(GemmSegment(seg, device_tensor(bias, self.device)))
        return tuple(segments)

    def forward(
        self,
        meta: Prepared,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        params: LayerAttention,
        out: torch.Tensor,
    ) -> None:
        """Each segment by matrix products or by SDPA (short ones, softcapped layers and
        windows the segment outgrows)."""
        sdpa: list[PrefillSegment] = []
        for m in meta:
            if isinstance(m, GemmSegment) and self._covers(m.segment, params):
                self._attend(m, layer, query, key, value, params, out)
            else:
                sdpa.append(m.segment if isinstance(m, GemmSegment) else m)
        if sdpa:
            self.sdpa.forward(tuple(sdpa), layer, query, key, value, params, out)

    @staticmethod
    def _covers(seg: PrefillSegment, params: LayerAttention) -> bool:
        """The products attend `seg` in this layer: no softcap, no window it outgrows."""
        keys = seg.num_cached + seg.q_end - seg.q_start
        return params.softcap is None and (params.window is None or keys <= params.window)

    def _attend(
        self,
        m: GemmSegment,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        params: LayerAttention,
        out: torch.Tensor,
    ) -> None:
        """One segment: per kv head, scores of its stacked query heads, mask, softmax, values."""
        seg = m.segment
        n = seg.q_end - seg.q_start
        heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[3]
        per_kv = heads // kv_heads
        if seg.key_slots is None:  # fresh K/V: [kv_heads, n, dim]
            k = key[0, :, seg.q_start : seg.q_end].contiguous()
            v_t = value[0, :, seg.q_start : seg.q_end].transpose(1, 2).contiguous()
        else:  # read back from the cache: [slots, kv_heads, dim] -> per kv head
            k_cache, v_cache = self.kv_caches[layer]
            k_flat = k_cache.view(-1, kv_heads, dim)
            v_flat = v_cache.view(-1, kv_heads, dim)
            k = k_flat.index_select(0, seg.key_slots).permute(1, 0, 2).contiguous()
            v_t = v_flat.index_select(0, seg.key_slots).permute(1, 2, 0).contiguous()
        # [kv_heads, per_kv * n, dim]: each kv head's query heads, one after another
        q = query[0, :, seg.q_start : seg.q_end].reshape(kv_heads, per_kv * n, dim)
        o = out[seg.q_start : seg.q_end]  # [n, heads, dim]
        for g in range(kv_heads):
            scores = _product(q[g], k[g]).view(per_kv, n, -1)
            scores.mul_(params.scale)
            scores.add_(m.bias)
            probs = torch.softmax(scores, dim=-1).view(per_kv * n, -1)
            o[:, g * per_kv : (g + 1) * per_kv] = (
                _product(probs, v_t[g]).view(per_kv, n, dim).transpose(0, 1)
            )
