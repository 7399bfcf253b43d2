"""The decode kernels' vector paths (`actors.kernels`: AVX-512 where the CPU has it, the plain
C path built with `-mno-avx512f`) against exact attention on random data: float32 and
bfloat16, softcap, sliding window, one key, partial blocks, head_dim 64, 128 and 40."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from actors import EngineConfig, kernels
from actors.attention.select import make_backend
from actors.attention.shared_prefix import SharedPrefixDecodeBackend
from actors.dtypes import cpu_info
from tests.actors.reference import torch_threads
from tests.actors.test_kernels import random_case

SCALE = 0.17


def exact(q, k_cache, v_cache, tables, seq_lens, window=None, softcap=None):
    """Each sequence alone in float64: its last `window` keys, scores capped, softmax, V."""
    _, block_size, kv_heads, dim = k_cache.shape
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, length in enumerate(seq_lens.tolist()):
        slots = torch.arange(max(0, length - window) if window else 0, length)
        slots = tables[i, slots // block_size] * block_size + slots % block_size
        k = k_cache.double().view(-1, kv_heads, dim)[slots].repeat_interleave(group, 1)
        v = v_cache.double().view(-1, kv_heads, dim)[slots].repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", q[i].double(), k) * SCALE
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        out[i] = torch.einsum("ht,thd->hd", scores.softmax(-1), v)
    return out


def check(kernel, dtype, dim, block_size, window, softcap) -> None:
    lengths = [1, 7, 16, 33, 70, 129]  # one key, partial blocks, a block's end
    q, k_cache, v_cache, tables, seq_lens = random_case(
        len(lengths), 6, 2, dim, block_size, 129, seed=dim + block_size, lengths=lengths
    )
    q, k_cache, v_cache = (t.to(dtype) for t in (q, k_cache, v_cache))
    out = torch.full_like(q, float("nan"))
    with torch_threads(2):
        kernel(q, k_cache, v_cache, tables, seq_lens, SCALE, out, None, window, softcap)
    want = exact(q, k_cache, v_cache, tables, seq_lens, window, softcap).float()
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-5, "rtol": 2**-8}
    torch.testing.assert_close(out.float(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    ("dim", "block_size", "window", "softcap"),
    [
        (64, 16, None, None),
        (128, 16, 20, None),
        (64, 6, None, 1.5),
        (40, 16, 9, 2.0),
        (64, 32, 45, None),
    ],
    ids=["d64", "d128-window", "d64-block6-softcap", "d40-window-softcap", "d64-block32-window"],
)
def test_plain_kernel_equals_exact_attention(dtype, dim, block_size, window, softcap) -> None:
    kernel = kernels.paged_decode_kernel("cpu", dtype)
    assert kernel is not None
    check(kernel, dtype, dim, block_size, window, softcap)


def runs_case(dim: int, block: int, seed: int):
    """Three runs (one block, five, three) read by 6, 70 (two work items) and 9 rows per kv
    head, in the layout `PagedDecode.runs` takes."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads = 2
    k_cache = torch.randn(40, block, kv_heads, dim, generator=gen)
    v_cache = torch.randn(40, block, kv_heads, dim, generator=gen)
    blocks = [[7], [3, 9, 1, 30, 2], [12, 13, 14]]
    per_head = [6, 70, 9]
    tables = torch.tensor([b + [0] * (5 - len(b)) for b in blocks])
    keys = torch.tensor([len(b) * block for b in blocks])
    start = torch.tensor([0] + [kv_heads * p for p in per_head]).cumsum(0)
    q = torch.randn(int(start[-1]), dim, generator=gen)
    return q, k_cache, v_cache, tables, keys, start, blocks, per_head


def check_runs(kernel, dim: int, block: int, softcap: float | None) -> None:
    q, k_cache, v_cache, tables, keys, start, blocks, per_head = runs_case(dim, block, dim)
    kv_heads = k_cache.shape[2]
    out, lse = torch.empty(len(q), dim), torch.empty(len(q))
    with torch_threads(2):
        kernel.runs(q, k_cache, v_cache, tables, keys, start, SCALE, out, lse, softcap)
    for r, ids in enumerate(blocks):
        rows = q[int(start[r]) : int(start[r + 1])].double().view(kv_heads, per_head[r], dim)
        k = k_cache[ids].double().reshape(-1, kv_heads, dim).transpose(0, 1)
        v = v_cache[ids].double().reshape(-1, kv_heads, dim).transpose(0, 1)
        scores = rows @ k.transpose(1, 2) * SCALE
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        got = out[int(start[r]) : int(start[r + 1])].view(kv_heads, per_head[r], dim)
        want = (torch.softmax(scores, -1) @ v).float()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        got_lse = lse[int(start[r]) : int(start[r + 1])].view(kv_heads, per_head[r])
        want_lse = torch.logsumexp(scores, -1).float()
        torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("dim", "block"), [(64, 16), (128, 16), (48, 6), (80, 32)])
def test_run_mode_tiles_equal_exact_attention(dim, block) -> None:
    """The run mode's tiles: head_dim 64, 128 and ones that leave partial column tiles (48:
    3 vectors, 80: 5), a block size that is not a multiple of the 8-key tile (6), and one of
    two 16-key halves (32)."""
    kernel = kernels.paged_decode_kernel("cpu", torch.float32)
    assert kernel is not None
    check_runs(kernel, dim, block, 1.5 if block == 6 else None)


def test_the_path_for_cpus_without_avx512(tmp_path: Path) -> None:
    """The float32 library built with -mno-avx512f (the plain C path other CPUs take) on the
    same cases: plain decode with window and softcap, and the run mode."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    flags = (*kernels.FLAGS, "-mno-avx512f")
    library = kernels.load_library(compiler, tmp_path, kernels.SOURCE, flags)
    assert library is not None
    kernel = kernels.PagedDecode(library, torch.float32)
    assert not kernel.tiled_runs  # so the engine's default leaves its runs off
    check(kernel, torch.float32, 64, 16, 20, 1.5)
    check(kernel, torch.float32, 40, 6, None, None)
    check_runs(kernel, 64, 16, None)


def test_shared_prefix_attention_by_default_only_where_the_runs_have_their_tiles() -> None:
    """`EngineConfig.shared_prefix_attention` None: the shared-prefix decodes where the kernel
    was built with its AVX-512 run tiles (on an AVX2-only CPU the plain runs were slower than
    each decode reading its blocks); True and False as asked, on either CPU."""
    native = {kernels.paged_decode_kernel("cpu", d).tiled_runs for d in kernels.KERNELS}
    assert native == {"avx512f" in cpu_info().flags}  # what -march=native compiles for
    caches = [(torch.zeros(4, 16, 2, 64),) * 2]
    for choice, expected in ((None, native == {True}), (True, True), (False, False)):
        backend = make_backend("cpu_kernel", caches, choice)
        assert isinstance(backend.decode, SharedPrefixDecodeBackend) == expected, choice
    assert EngineConfig().shared_prefix_attention is None
