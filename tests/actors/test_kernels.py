"""The compiled paged decode attention (`actors.kernels`) against SDPA on gathered keys."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from actors import kernels
from actors.attention import build_metadata, paged_attention
from packing.layout import slot_mapping
from tests.actors.reference import torch_threads


@pytest.fixture(scope="module")
def kernel() -> kernels.PagedDecode:
    built = kernels.paged_decode_kernel("cpu", torch.float32)
    assert built is not None, "CI machines have a C compiler: the kernel must build"
    return built


def reference(q, k_cache, v_cache, tables, seq_lens):
    """Each sequence alone: its keys gathered in order, SDPA with grouped heads."""
    _, block_size, kv_heads, dim = k_cache.shape
    out = torch.empty_like(q)
    for i, length in enumerate(seq_lens.tolist()):
        slots = torch.arange(length)
        slots = tables[i, slots // block_size] * block_size + slots % block_size
        k = k_cache.view(-1, kv_heads, dim)[slots].transpose(0, 1)[None]  # [1, kv, len, dim]
        v = v_cache.view(-1, kv_heads, dim)[slots].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q[i][None, :, None], k, v, enable_gqa=True)
        out[i] = o[0, :, 0]
    return out


def random_case(num_seqs, heads, kv_heads, dim, block_size, max_len, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = num_seqs * -(-max_len // block_size) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    seq_lens = torch.randint(1, max_len + 1, (num_seqs,), generator=gen)
    seq_lens[0] = 1  # one key only
    seq_lens[-1] = block_size * (max_len // block_size)  # ends on a block boundary
    width = -(-int(seq_lens.max()) // block_size)
    # blocks in a shuffled order, each sequence's table padded with block 0
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(num_seqs, width, dtype=torch.int64)
    used = 0
    for i, length in enumerate(seq_lens.tolist()):
        n = -(-length // block_size)
        tables[i, :n] = order[used : used + n]
        used += n
    q = torch.randn(num_seqs, heads, dim, generator=gen)
    return q, k_cache, v_cache, tables, seq_lens


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"),
    [(9, 3, 64, 16), (3, 3, 16, 4), (4, 1, 32, 16), (6, 2, 8, 1)],
    ids=["smollm2", "mha-odd", "mqa", "block1"],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_equals_sdpa(kernel, heads, kv_heads, dim, block_size, threads) -> None:
    q, k_cache, v_cache, tables, seq_lens = random_case(
        13, heads, kv_heads, dim, block_size, max_len=70, seed=heads * dim + block_size
    )
    out = torch.full_like(q, float("nan"))
    with torch_threads(threads):
        kernel(q, k_cache, v_cache, tables, seq_lens, dim**-0.5, out)
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, tables, seq_lens))


def test_paged_attention_decodes_equal_with_and_without_kernel(kernel) -> None:
    """Through the attention function: two decodes and a fresh prefill in one step."""
    layers, blocks, block_size, kv_heads, dim, heads = 2, 12, 4, 2, 8, 6
    gen = torch.Generator().manual_seed(3)
    caches = [
        tuple(torch.randn(blocks, block_size, kv_heads, dim, generator=gen) for _ in "kv")
        for _ in range(layers)
    ]
    num_cached, num_new = np.array([5, 9, 0]), np.array([1, 1, 3])
    tables = [[0, 1], [2, 3, 4], [5]]
    slots = slot_mapping(num_cached, num_new, tables, block_size)
    cu_q = np.array([0, 1, 2, 5])
    q = torch.randn(1, heads, 5, dim, generator=gen)
    k = torch.randn(1, kv_heads, 5, dim, generator=gen)
    v = torch.randn(1, kv_heads, 5, dim, generator=gen)

    class Layer(torch.nn.Module):
        layer_idx = 1

    outs = []
    for decode_kernel in (kernel, None):
        copies = [(kc.clone(), vc.clone()) for kc, vc in caches]
        meta = build_metadata(
            copies,
            num_cached,
            num_new,
            tables,
            slots,
            cu_q,
            block_size,
            2,
            torch.device("cpu"),
            decode_kernel=decode_kernel,
        )
        assert (meta.decode_batch is not None) == (decode_kernel is not None)
        assert len(meta.decodes) == (0 if decode_kernel else 1)
        out, _ = paged_attention(Layer(), q, k, v, None, raypack_attention=meta)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1])


def test_bad_arguments_are_named(kernel) -> None:
    q, k_cache, v_cache, tables, seq_lens = random_case(3, 4, 2, 8, 4, 9, seed=0)
    with pytest.raises(ValueError, match="block_tables"):
        kernel(q, k_cache, v_cache, tables.int(), seq_lens, 1.0, torch.empty_like(q))
    with pytest.raises(ValueError, match="out"):
        kernel(q, k_cache, v_cache, tables, seq_lens, 1.0, torch.empty(3, 8, 4).transpose(1, 2))
    with pytest.raises(ValueError, match="num_heads"):
        kernel(q[:, :3].contiguous(), k_cache, v_cache, tables, seq_lens, 1.0, torch.empty(3, 3, 8))


def test_no_kernel_off_cpu_float32() -> None:
    assert kernels.paged_decode_kernel("cpu", torch.bfloat16) is None
    assert kernels.paged_decode_kernel("meta", torch.float32) is None


def test_a_failed_build_falls_back_with_a_warning(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="actors.kernels"):
        assert kernels.load_library("false", tmp_path) is None
        assert kernels.load_library(None, tmp_path) is None
    assert "could not build" in caplog.text and "no C compiler" in caplog.text
    assert not list(tmp_path.iterdir())  # no half-written library left behind


def test_the_build_is_cached(tmp_path: Path, kernel) -> None:
    first = kernels.load_library("cc", tmp_path)
    assert first is not None
    (built,) = tmp_path.iterdir()
    stamp = built.stat().st_mtime_ns
    assert kernels.load_library("false", tmp_path) is not None  # found: nothing compiled
    assert built.stat().st_mtime_ns == stamp


def test_loading_the_kernel_keeps_subnormal_floats(tmp_path: Path) -> None:
    """A library linked with -ffast-math would switch on flush-to-zero for the whole process
    when it loads; ours must not (checked in a fresh process, before and after)."""
    code = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from actors import kernels\n"
        "before = sys.float_info.min / 2 > 0\n"
        f"assert kernels.load_library('cc', Path({str(tmp_path)!r})) is not None\n"
        "after = sys.float_info.min / 2 > 0\n"
        "tiny = torch.tensor([1e-40]) * 1.0\n"
        "print(before, after, bool(tiny.item() > 0))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["True", "True", "True"], done.stdout + done.stderr
