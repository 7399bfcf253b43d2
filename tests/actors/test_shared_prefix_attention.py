"""Shared-prefix decode attention (`actors.attention.shared_prefix`) on random tensors: the
runs it finds in block tables, and its merged output against each decode attended alone by
plain SDPA and against the plain kernel, at float32 tolerance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from actors.attention import AttentionMetadata, StepBatch, make_backend, paged_attention
from actors.attention.shared_prefix import (
    SharedPrefixDecodeBackend,
    SharedPrefixDecodes,
    shared_runs,
)
from actors.kernels import paged_decode_kernel
from packing.layout import flat_layout, padded_block_tables, slot_mapping, token_slots
from tests.actors.attention_step import reference_eager

pytestmark = pytest.mark.skipif(
    paged_decode_kernel("cpu", torch.float32) is None, reason="no C compiler for the kernel"
)

BLOCK = 4
SCALE = 0.17


class Layer(torch.nn.Module):
    layer_idx = 0


def nested_tables() -> tuple[list[list[int]], np.ndarray]:
    """Seven decodes: an outer run of 5 blocks shared by 0-4 (ids not consecutive), inside it
    a run of 3 more blocks shared by 1, 3, 4 (members not consecutive), inside that 2 more
    shared by 3 and 4; decode 5 and 6 share 2 consecutive blocks; one decode alone
    (appended below); block 40+ are each decode's own."""
    outer = [17, 3, 9, 30, 4]
    inner = [11, 12, 13]
    deepest = [20, 21]
    tables = [
        outer + [40, 41],
        outer + inner + [42],
        outer + [43, 44, 45],
        outer + inner + deepest + [46],
        outer + inner + deepest + [47, 48],
        [25, 26, 49],
        [25, 26, 50, 51],
        [52, 53, 54],
    ]
    own_keys = np.array([5, 2, 9, 1, 6, 3, 7, 10])  # keys past the tables' shared blocks
    shared = np.array([5, 8, 5, 10, 10, 2, 2, 0]) * BLOCK
    return tables, shared + own_keys  # keys per decode, the new one included


def test_runs_nest_and_skip_partial_blocks() -> None:
    tables, keys = nested_tables()
    padded = padded_block_tables(tables)
    runs, own_start = shared_runs(padded, (keys - 1) // BLOCK)
    found = [(list(rows), first, end) for rows, first, end in runs]
    assert found == [
        ([0, 1, 2, 3, 4], 0, 5),
        ([1, 3, 4], 5, 8),
        ([3, 4], 8, 10),
        ([5, 6], 0, 2),
    ]
    assert list(own_start) == [5, 8, 5, 10, 10, 2, 2, 0]
    # A block holding the new token is never shared: two decodes whose only common block is
    # the one being written share nothing.
    runs, own_start = shared_runs(np.array([[7, 1], [7, 2]]), np.array([0, 0]))
    assert runs == [] and list(own_start) == [0, 0]


def decode_step(heads: int, kv_heads: int, dim: int, seed: int, layout=nested_tables):
    tables, keys = layout()
    gen = torch.Generator().manual_seed(seed)
    shape = (64, BLOCK, kv_heads, dim)
    caches = [(torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen))]
    n = len(tables)
    q = torch.randn(1, heads, n, dim, generator=gen)
    k = torch.randn(1, kv_heads, n, dim, generator=gen)
    v = torch.randn(1, kv_heads, n, dim, generator=gen)
    cached, new = keys - 1, np.ones(n, dtype=np.int64)
    batch = StepBatch(cached, new, tables, flat_layout(cached, new).cu_seqlens_q, n, BLOCK)
    return tables, keys, caches, (q, k, v), batch


def run(shared: bool, step, min_keys: int = 1, **layer) -> tuple[torch.Tensor, object]:
    tables, keys, caches, (q, k, v), batch = step
    caches = [(kc.clone(), vc.clone()) for kc, vc in caches]
    backend = make_backend("cpu_kernel", caches, shared, min_keys)
    slots = slot_mapping(batch.num_cached, batch.num_new, tables, BLOCK)
    meta = AttentionMetadata.build(backend, batch, slots)
    out, _ = paged_attention(Layer(), q, k, v, None, scaling=SCALE, raypack_attention=meta, **layer)
    return out[0], meta.prepared


def alone(step, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Each decode alone: SDPA over its keys read from the cache after the step's write
    (Hugging Face's eager attention with a window or a softcap)."""
    tables, keys, caches, (q, k, v), batch = step
    k_cache, v_cache = (c.clone() for c in caches[0])
    _, _, kv_heads, dim = k_cache.shape
    slots = torch.from_numpy(slot_mapping(batch.num_cached, batch.num_new, tables, BLOCK))
    k_cache.view(-1, kv_heads, dim)[slots] = k[0].transpose(0, 1)
    v_cache.view(-1, kv_heads, dim)[slots] = v[0].transpose(0, 1)
    out = torch.empty(len(tables), q.shape[1], dim)
    for i, table in enumerate(tables):
        index = torch.from_numpy(token_slots(table, int(keys[i]), BLOCK))
        ki = k_cache.view(-1, kv_heads, dim)[index].transpose(0, 1)  # [kv_heads, keys, dim]
        vi = v_cache.view(-1, kv_heads, dim)[index].transpose(0, 1)
        qi = q[0, :, i : i + 1]  # [heads, 1, dim]
        if window is not None or softcap is not None:
            kv = (ki.transpose(0, 1), vi.transpose(0, 1))  # [keys, kv_heads, dim]
            position = torch.tensor([int(keys[i]) - 1])
            out[i] = reference_eager(qi, *kv, position, window, softcap, SCALE)[0]
            continue
        out[i] = F.scaled_dot_product_attention(qi, ki, vi, scale=SCALE, enable_gqa=True)[:, 0]
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(6, 2, 64), (3, 3, 16), (8, 1, 8)])
def test_merged_attention_equals_plain_attention(heads, kv_heads, dim) -> None:
    step = decode_step(heads, kv_heads, dim, seed=heads * dim)
    merged, prepared = run(True, step)
    decode_meta, _ = prepared
    assert isinstance(decode_meta, SharedPrefixDecodes) and len(decode_meta.runs) == 4
    plain, _ = run(False, step)
    expected = alone(step)
    torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("layer", "shares"),
    [
        (dict(softcap=1.5), True),  # runs computed eagerly, capped as the kernel caps
        (dict(sliding_window=6), False),  # shorter than the decodes: the plain kernel
        (dict(sliding_window=50, softcap=2.0), True),  # every decode within it: shared
    ],
)
def test_merged_attention_windows_and_softcaps(layer, shares) -> None:
    step = decode_step(6, 2, 64, seed=11)
    merged, (decode_meta, _) = run(True, step, **layer)
    assert isinstance(decode_meta, SharedPrefixDecodes) and decode_meta.longest == 46
    assert (layer.get("sliding_window", 10**6) >= decode_meta.longest) == shares
    plain, _ = run(False, step, **layer)
    expected = alone(step, layer.get("sliding_window"), layer.get("softcap"))
    torch.testing.assert_close(plain, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-5)
    if layer.get("sliding_window") != 50:  # the window or the cap changes the answer
        assert not torch.allclose(merged, alone(step), atol=1e-3)


def outer_small_inner_large() -> tuple[list[list[int]], np.ndarray]:
    """One block shared by three decodes, four more shared by two of them."""
    tables = [[1, 10, 11, 12, 13, 30, 31], [1, 10, 11, 12, 13, 32], [1, 20, 33]]
    return tables, np.array([26, 21, 10])


def test_runs_below_the_minimum_stay_in_each_decodes_own_part() -> None:
    """Outer run 3 x 4 keys < 20 <= inner run 2 x 16: the inner run alone is read apart, so
    decode 0's own part is block 1 and its blocks after the inner run (not contiguous)."""
    step = decode_step(4, 2, 16, seed=7, layout=outer_small_inner_large)
    merged, (decode_meta, _) = run(True, step, min_keys=20)
    assert isinstance(decode_meta, SharedPrefixDecodes)
    assert [r.num_keys for r in decode_meta.runs] == [16]
    assert decode_meta.block_tables[0, :3].tolist() == [1, 30, 31]
    assert decode_meta.seq_lens.tolist() == [10, 5, 10]
    torch.testing.assert_close(merged, alone(step), atol=1e-5, rtol=1e-5)
    _, (plain_meta, _) = run(True, step, min_keys=33)  # no run reaches it: the plain kernel
    assert not isinstance(plain_meta, SharedPrefixDecodes)


def test_merged_attention_in_bfloat16() -> None:
    """bf16 caches and queries: the kernel's own parts (float32 log-sum-exps) merged with
    the runs (float32 outputs), within bf16 rounding of the exact attention of the same inputs."""
    tables, keys, caches, qkv, batch = decode_step(6, 2, 64, seed=7)
    caches = [(kc.bfloat16(), vc.bfloat16()) for kc, vc in caches]
    step = (tables, keys, caches, tuple(t.bfloat16() for t in qkv), batch)
    merged, prepared = run(True, step)
    assert isinstance(prepared[0], SharedPrefixDecodes) and len(prepared[0].runs) == 4
    plain, _ = run(False, step)
    exact = alone(
        (
            tables,
            keys,
            [(kc.float(), vc.float()) for kc, vc in caches],
            tuple(t.float() for t in step[3]),
            batch,
        )
    )
    torch.testing.assert_close(plain.float(), exact, atol=1e-5, rtol=2**-8)
    torch.testing.assert_close(merged.float(), exact, atol=2e-2, rtol=2e-2)


def chain_tables() -> tuple[list[list[int]], np.ndarray]:
    """Twelve decodes, decode i's table blocks 0..i then two own: block j is shared by
    decodes j..11, so decode 11 is read in 11 nested runs (11 merges)."""
    tables = [list(range(i + 1)) + [20 + 2 * i, 21 + 2 * i] for i in range(12)]
    own_keys = np.array([3, 5, 2, 7, 4, 6, 1, 8, 3, 5, 2, 6])
    return tables, (np.arange(12) + 1) * BLOCK + own_keys


def test_bfloat16_merges_run_in_float32() -> None:
    """In bf16 the pieces (the kernel's own parts) are bf16, but the
    merges run in float32 and round once: over 11 nested runs the merged output stays within
    2x the plain kernel's mean error against exact attention (measured 1.5x; merges rounded
    to bf16 at each run measured 2.6-2.8x)."""
    for seed in range(2):
        tables, keys, caches, qkv, batch = decode_step(6, 2, 64, seed=seed, layout=chain_tables)
        caches = [(kc.bfloat16(), vc.bfloat16()) for kc, vc in caches]
        qkv = tuple(t.bfloat16() for t in qkv)
        step = (tables, keys, caches, qkv, batch)
        merged, (decode_meta, _) = run(True, step)
        assert isinstance(decode_meta, SharedPrefixDecodes) and len(decode_meta.runs) == 11
        assert merged.dtype == torch.bfloat16
        plain, _ = run(False, step)
        wide = [(kc.float(), vc.float()) for kc, vc in caches]
        exact = alone((tables, keys, wide, tuple(t.float() for t in qkv), batch))
        merged_error = (merged.float() - exact).abs().mean()
        plain_error = (plain.float() - exact).abs().mean()
        assert merged_error <= 2 * plain_error, (float(merged_error), float(plain_error))


def test_kernel_log_sum_exp_is_that_of_the_scores() -> None:
    kernel = paged_decode_kernel("cpu", torch.float32)
    assert kernel is not None
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(8, BLOCK, 2, 16, generator=gen), torch.randn(8, BLOCK, 2, 16)
    q = torch.randn(2, 4, 16, generator=gen)
    tables = torch.tensor([[5, 1, 2], [0, 7, 3]])
    lens = torch.tensor([11, 6])
    out, lse = torch.empty_like(q), torch.empty(2, 4)
    kernel(q, k_cache, v_cache, tables, lens, SCALE, out, lse)
    for i in range(2):
        index = torch.from_numpy(token_slots(tables[i].tolist(), int(lens[i]), BLOCK))
        keys = k_cache.view(-1, 2, 16)[index].repeat_interleave(2, dim=1)  # [keys, 4, 16]
        scores = torch.einsum("hd,khd->hk", q[i], keys) * SCALE
        torch.testing.assert_close(lse[i], torch.logsumexp(scores, -1), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"lse must be \[num_seqs, num_heads\]"):
        kernel(q, k_cache, v_cache, tables, lens, SCALE, out, torch.empty(2, 3))


def test_a_step_that_shares_nothing_runs_the_plain_kernel() -> None:
    step = decode_step(4, 2, 8, seed=1)
    tables, keys, caches, qkv, batch = step
    alone_batch = StepBatch(
        batch.num_cached[-1:], batch.num_new[-1:], tables[-1:], np.array([0, 1]), 1, BLOCK
    )
    kernel = paged_decode_kernel("cpu", torch.float32)
    assert kernel is not None
    backend = SharedPrefixDecodeBackend(caches, kernel)
    assert not isinstance(backend.prepare(alone_batch), SharedPrefixDecodes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block", "softcap"), [(16, None), (6, 1.5)])
def test_run_mode_equals_exact_attention(dtype, block, softcap) -> None:
    """The kernel's run mode (`PagedDecode.runs`) on random data: runs of one block, of many
    blocks (a block size that is not a multiple of the 8-key tile), of more rows than one
    work item (70 > 64), each row against exact float32 attention and its log-sum-exp."""
    kernel = paged_decode_kernel("cpu", dtype)
    assert kernel is not None
    gen = torch.Generator().manual_seed(block)
    kv_heads, dim = 2, 32
    k_cache = torch.randn(40, block, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(40, block, kv_heads, dim, generator=gen).to(dtype)
    blocks = [[7], [3, 9, 1, 30, 2], [12, 13, 14]]
    per_head = [6, 70, 9]  # rows per kv head: members x heads per kv head
    tables = torch.tensor([b + [0] * (5 - len(b)) for b in blocks])
    keys = torch.tensor([len(b) * block for b in blocks])
    start = torch.tensor([0, *np.cumsum([kv_heads * p for p in per_head])])
    q = torch.randn(int(start[-1]), dim, generator=gen).to(dtype)
    out, lse = torch.empty(len(q), dim), torch.empty(len(q))
    kernel.runs(q, k_cache, v_cache, tables, keys, start, SCALE, out, lse, softcap)
    for r, ids in enumerate(blocks):
        rows = q[int(start[r]) : int(start[r + 1])].float().view(kv_heads, per_head[r], dim)
        k = k_cache[ids].float().reshape(-1, kv_heads, dim).transpose(0, 1)
        v = v_cache[ids].float().reshape(-1, kv_heads, dim).transpose(0, 1)
        scores = rows @ k.transpose(1, 2) * SCALE
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        got = out[int(start[r]) : int(start[r + 1])].view(kv_heads, per_head[r], dim)
        torch.testing.assert_close(got, torch.softmax(scores, -1) @ v, atol=1e-5, rtol=1e-5)
        got_lse = lse[int(start[r]) : int(start[r + 1])].view(kv_heads, per_head[r])
        torch.testing.assert_close(got_lse, torch.logsumexp(scores, -1), atol=1e-5, rtol=1e-5)
