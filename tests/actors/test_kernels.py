"""The compiled paged decode attention (`actors.kernels`) against SDPA on gathered keys."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from actors import kernels
from actors.attention import HybridBackend, make_backend
from actors.attention.kernel import KernelDecodeBackend
from actors.attention.sdpa import SdpaDecodeBackend
from tests.actors.attention_step import attend, make_step
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


def random_case(num_seqs, heads, kv_heads, dim, block_size, max_len, seed, lengths=None):
    """Random query and caches; key counts `lengths`, else random ones with a single key and
    a block-aligned count among them."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = num_seqs * -(-max_len // block_size) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    seq_lens = torch.randint(1, max_len + 1, (num_seqs,), generator=gen)
    seq_lens[0] = 1  # one key only
    seq_lens[-1] = block_size * (max_len // block_size)  # ends on a block boundary
    if lengths is not None:
        seq_lens = torch.tensor(lengths)
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


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(8, 2, 128), (4, 4, 96), (2, 1, 256), (3, 3, 40)]
)
@pytest.mark.parametrize("num_seqs", [1, 2])
def test_few_long_sequences_split_over_kv_heads(kernel, heads, kv_heads, dim, num_seqs) -> None:
    """The kernel splits (sequence, kv head) pairs over the threads, so one sequence's heads
    run on both; with the head sizes it compiles apart (96, 128, 256) and one it does not
    (40), and the log-sum-exps it writes for the shared-prefix merge."""
    lengths = [300, 263][:num_seqs]  # long, not block-aligned
    q, k_cache, v_cache, tables, seq_lens = random_case(
        num_seqs, heads, kv_heads, dim, 16, max_len=300, seed=dim + num_seqs, lengths=lengths
    )
    out = torch.full_like(q, float("nan"))
    lse = torch.full((num_seqs, heads), float("nan"))
    with torch_threads(2):
        kernel(q, k_cache, v_cache, tables, seq_lens, dim**-0.5, out, lse)
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, tables, seq_lens))
    _, block_size, _, _ = k_cache.shape
    for i, length in enumerate(seq_lens.tolist()):
        slots = torch.arange(length)
        slots = tables[i, slots // block_size] * block_size + slots % block_size
        k = k_cache.view(-1, kv_heads, dim)[slots].repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,thd->ht", q[i], k) * dim**-0.5
        torch.testing.assert_close(lse[i], scores.logsumexp(-1))


@pytest.mark.parametrize("threads", [1, 2])
def test_bfloat16_kernel_is_float32_attention_rounded_once(threads) -> None:
    """bf16 query and caches, float32 arithmetic inside: the output is the float32 attention
    of the same bf16 inputs, rounded once to bf16 (so within one bf16 rounding of it)."""
    kernel = kernels.paged_decode_kernel("cpu", torch.bfloat16)
    assert kernel is not None and kernel.dtype == torch.bfloat16
    case = random_case(13, 9, 3, 64, 16, max_len=70, seed=5)
    q, k_cache, v_cache = (t.bfloat16() for t in case[:3])
    tables, seq_lens = case[3:]
    out = torch.full_like(q, float("nan"))
    with torch_threads(threads):
        kernel(q, k_cache, v_cache, tables, seq_lens, 64**-0.5, out)
    exact = reference(q.float(), k_cache.float(), v_cache.float(), tables, seq_lens)
    torch.testing.assert_close(out.float(), exact, atol=1e-5, rtol=2**-8)
    with pytest.raises(ValueError, match="k_cache must be a contiguous CPU torch.bfloat16"):
        kernel(q.float(), k_cache.float(), v_cache.float(), tables, seq_lens, 1.0, out.float())


def test_paged_attention_decodes_equal_with_and_without_kernel(kernel) -> None:
    """Through the attention function: three decodes, an extend and a fresh prefill in one
    step, decodes by the kernel and by gathered SDPA."""
    step = make_step(heads=6, kv_heads=2, dim=8, seed=3)
    outs = []
    for name, decode_type in (("cpu_kernel", KernelDecodeBackend), ("sdpa", SdpaDecodeBackend)):

        def build(caches, name=name, decode_type=decode_type):
            backend = make_backend(name, caches)
            assert isinstance(backend, HybridBackend)
            assert isinstance(backend.decode, decode_type)
            return backend

        outs.append(attend(build, step))
    torch.testing.assert_close(outs[0], outs[1])


def test_bad_arguments_are_named(kernel) -> None:
    q, k_cache, v_cache, tables, seq_lens = random_case(3, 4, 2, 8, 4, 9, seed=0)
    with pytest.raises(ValueError, match="block_tables"):
        kernel(q, k_cache, v_cache, tables.int(), seq_lens, 1.0, torch.empty_like(q))
    with pytest.raises(ValueError, match="out"):
        kernel(q, k_cache, v_cache, tables, seq_lens, 1.0, torch.empty(3, 8, 4).transpose(1, 2))
    with pytest.raises(ValueError, match="num_heads"):
        kernel(q[:, :3].contiguous(), k_cache, v_cache, tables, seq_lens, 1.0, torch.empty(3, 3, 8))


def test_no_kernel_off_cpu_float32_or_bfloat16() -> None:
    assert kernels.paged_decode_kernel("cpu", torch.float16) is None
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
