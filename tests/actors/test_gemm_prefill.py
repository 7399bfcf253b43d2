"""Prefill attention by oneDNN matrix products (`actors.attention.gemm_prefill`): against
each request alone on random data (one block, many shuffled blocks, fresh prompts, decodes),
softcapped and outgrown sliding-window layers routed to SDPA, and the backend chosen only
for float32 on the C kernel's backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.attention import (
    AttentionMetadata,
    HybridBackend,
    StepBatch,
    make_backend,
    paged_attention,
)
from actors.attention.gemm_prefill import GemmPrefillBackend
from actors.attention.sdpa import SdpaPrefillBackend
from actors.cpu_linear import onednn_available
from packing.layout import flat_layout, slot_mapping, token_slots
from tests.actors.attention_step import Layer, attend, make_step, reference, reference_eager

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch without oneDNN")

BLOCK = 16
NUM_CACHED = np.array([0, 300, 5, 40])
NUM_NEW = np.array([70, 100, 8, 1])  # a fresh prompt, a long extend, one block, one row


def counted(backend: GemmPrefillBackend) -> list[int]:
    """Segments the products attended, per layer call (a spy around `_attend`)."""
    calls: list[int] = []
    original = backend._attend

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    backend._attend = spy  # type: ignore[method-assign]
    return calls


def long_step(heads: int, kv_heads: int, dim: int, **layer):
    """Four segments over shuffled blocks through `paged_attention`: the backend's output,
    the exact answer (each request alone, the eager softmax) and the segments the products took."""
    gen = torch.Generator().manual_seed(heads * dim)
    need = [-(-int(c + n) // BLOCK) for c, n in zip(NUM_CACHED, NUM_NEW, strict=True)]
    order = torch.randperm(sum(need), generator=gen).tolist()
    tables = [order[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(need))]
    caches = [(torch.randn(sum(need), BLOCK, kv_heads, dim, generator=gen),) * 2 for _ in "ab"]
    caches = [(k, torch.randn_like(k)) for k, _ in caches]
    tokens = int(NUM_NEW.sum())
    q = torch.randn(1, heads, tokens, dim, generator=gen)
    k, v = (torch.randn(1, kv_heads, tokens, dim, generator=gen) for _ in "kv")
    old = [(a.clone(), b.clone()) for a, b in caches]
    backend = GemmPrefillBackend(caches, min_rows=1)
    calls = counted(backend)
    batch = StepBatch(
        NUM_CACHED, NUM_NEW, tables, flat_layout(NUM_CACHED, NUM_NEW).cu_seqlens_q, 0, BLOCK
    )
    slots = slot_mapping(NUM_CACHED, NUM_NEW, tables, BLOCK)
    meta = AttentionMetadata.build(backend, batch, slots)
    out, _ = paged_attention(Layer(), q, k, v, None, scaling=0.125, raypack_attention=meta, **layer)
    expected = torch.empty(tokens, heads, dim)
    k_old, v_old = old[Layer.layer_idx]
    rows = np.concatenate([[0], np.cumsum(NUM_NEW)])
    for i, cached in enumerate(NUM_CACHED):
        lo, hi = rows[i], rows[i + 1]
        read = torch.from_numpy(token_slots(tables[i], int(cached), BLOCK))
        keys = torch.cat([k_old.view(-1, kv_heads, dim)[read], k[0, :, lo:hi].transpose(0, 1)])
        values = torch.cat([v_old.view(-1, kv_heads, dim)[read], v[0, :, lo:hi].transpose(0, 1)])
        expected[lo:hi] = reference_eager(
            q[0, :, lo:hi],
            keys,
            values,
            cached + torch.arange(hi - lo),
            layer.get("sliding_window"),
            layer.get("softcap"),
        )
    return out[0], expected, len(calls)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 16), (4, 1, 8)])
def test_products_match_each_request_alone(heads, kv_heads, dim) -> None:
    out, expected, products = long_step(heads, kv_heads, dim)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert products == len(NUM_NEW)  # every segment (min_rows=1) by the products


@pytest.mark.parametrize(
    ("layer", "products"),
    [
        (dict(softcap=1.5), 0),  # softcap: SDPA's eager path for every segment
        (dict(sliding_window=50), 2),  # the fresh prompt and the long extend outgrow it
        (dict(sliding_window=500), 4),  # every segment within the window: causal
    ],
    ids=["softcap", "window50", "window500"],
)
def test_softcaps_and_outgrown_windows_take_sdpa(layer, products) -> None:
    out, expected, taken = long_step(6, 2, 32, **layer)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert taken == products


def test_a_mixed_step_matches_each_request_alone() -> None:
    """The shared attention-step fixture (decodes, an extend, a fresh prompt)."""
    step = make_step(6, 2, 64, seed=3)
    out = attend(lambda caches: GemmPrefillBackend(caches, min_rows=1), step)
    torch.testing.assert_close(out, reference(step))


def test_short_segments_stay_on_sdpa() -> None:
    """At the default minimum, the 70- and 100-row segments by the products, not the rest."""
    backend = GemmPrefillBackend([(torch.zeros(40, BLOCK, 2, 8),) * 2])
    cu = flat_layout(NUM_CACHED, NUM_NEW).cu_seqlens_q
    meta = backend.prepare(StepBatch(NUM_CACHED, NUM_NEW, [list(range(30))] * 4, cu, 0, BLOCK))
    kinds = [type(m).__name__ for m in meta]
    assert kinds == ["GemmSegment", "GemmSegment", "PrefillSegment", "PrefillSegment"]


def test_float32_cpu_kernel_backend_takes_the_products() -> None:
    f32 = make_backend("cpu_kernel", [(torch.zeros(4, 16, 2, 8),) * 2])
    bf16 = make_backend("cpu_kernel", [(torch.zeros(4, 16, 2, 8, dtype=torch.bfloat16),) * 2])
    sdpa = make_backend("sdpa", [(torch.zeros(4, 16, 2, 8),) * 2])
    assert isinstance(f32, HybridBackend) and isinstance(f32.prefill, GemmPrefillBackend)
    assert isinstance(bf16, HybridBackend) and isinstance(bf16.prefill, SdpaPrefillBackend)
    assert isinstance(sdpa, HybridBackend) and isinstance(sdpa.prefill, SdpaPrefillBackend)
    with pytest.raises(ValueError, match="needs float32 on CPU"):
        GemmPrefillBackend([(torch.zeros(4, 16, 2, 8, dtype=torch.bfloat16),) * 2])
