"""CPU kernels compiled on first use: the paged decode attention (`paged_decode.c`).

torch has no paged attention on CPU (its varlen kernel is CUDA only, and IPEX, which has
one, last released for torch 2.8), so raypack ships one small C file and builds it with the
machine's C compiler (`$CC`, else `cc`) into `~/.cache/raypack/kernels`
(`$RAYPACK_CACHE_DIR/kernels`), then calls it through `ctypes` (no torch
headers, so the build takes well under a second). The library is keyed by the source, the
flags and the CPU's feature flags, because `-march=native` code must only run on the CPU it
was built for (a home directory shared by unlike nodes keeps one build per kind of CPU).

When no compiler works, `paged_decode_kernel` logs why once and returns None, and the
attention falls back to gathering blocks for SDPA: slower, the same tokens.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
# Compiled with -ffast-math (vectorized expf and float sums) but LINKED without it: a link
# with -ffast-math adds crtfastmath.o (GCC < 13), whose constructor sets flush-to-zero and
# denormals-are-zero for the whole process when the library loads (torch's numerics, and
# hypothesis's float strategies, noticed).
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC")
# OpenMP splits sequences over torch's threads; without it the kernel runs on one thread.
OPENMP = ("-fopenmp",)


class PagedDecode:
    """The compiled `raypack_paged_decode_f32`, called with torch tensors."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.raypack_paged_decode_f32
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, ctypes.c_float]
        fn.argtypes += [ptr, i64]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(
        self,
        query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
        seq_lens: torch.Tensor,  # [num_seqs] int64: keys per sequence, its new token included
        scale: float,
        out: torch.Tensor,  # [num_seqs, num_heads, head_dim], written
    ) -> None:
        """Attend each sequence's one query to its keys in the paged cache, into `out`."""
        num_seqs, num_heads, head_dim = query.shape
        _, block_size, kv_heads, _ = k_cache.shape
        for name, t, dtype in (
            ("query", query, torch.float32),
            ("k_cache", k_cache, torch.float32),
            ("v_cache", v_cache, torch.float32),
            ("out", out, torch.float32),
            ("block_tables", block_tables, torch.int64),
            ("seq_lens", seq_lens, torch.int64),
        ):
            if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor")
        if out.shape != query.shape or not len(block_tables) == num_seqs == len(seq_lens):
            raise ValueError("query, out, block_tables and seq_lens disagree on num_seqs")
        if num_heads % kv_heads or v_cache.shape != k_cache.shape:
            raise ValueError("num_heads must be a multiple of kv_heads; K and V caches alike")
        if num_seqs == 0:
            return
        failed = self._fn(
            query.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.shape[1],
            seq_lens.data_ptr(),
            num_seqs,
            num_heads,
            kv_heads,
            head_dim,
            block_size,
            scale,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("paged decode attention could not allocate its scratch memory")


def paged_decode_kernel(device: torch.device | str, dtype: torch.dtype) -> PagedDecode | None:
    """The compiled kernel for float32 on CPU, else (or when it cannot be built) None."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return None
    library = _load()
    return None if library is None else PagedDecode(library)


@functools.cache  # one build and load per process; the library never changes once loaded
def _load() -> ctypes.CDLL | None:
    from actors.loader import cache_dir  # beside the converted models ($RAYPACK_CACHE_DIR)

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    return load_library(compiler, cache_dir() / "kernels")


def load_library(compiler: str | None, cache_dir: Path) -> ctypes.CDLL | None:
    """Build `paged_decode.c` with `compiler` into `cache_dir` unless built already, and load
    it; None (with a warning) when there is no compiler or the build fails."""
    if compiler is None:
        logger.warning("no C compiler on PATH: decode attention gathers blocks for SDPA")
        return None
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), _cpu_signature().encode()):
        key.update(part)
    target = cache_dir / f"paged_decode-{key.hexdigest()[:16]}.so"
    if not target.exists():
        try:
            _build(compiler, target)
        except (OSError, subprocess.SubprocessError) as exc:
            logger.warning("could not build %s (%s): decode attention gathers blocks", SOURCE, exc)
            return None
    return ctypes.CDLL(str(target))


def _build(compiler: str, target: Path) -> None:
    """Compile into a temporary file beside `target`, then rename it into place: processes
    building at once (Ray workers on one node) never load a half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = tmp[: -len(".so")] + ".o"

    def run(*args: str) -> None:
        subprocess.run([compiler, *args], check=True, capture_output=True, timeout=120)

    try:
        try:  # OpenMP where the compiler has it
            run(*FLAGS, *OPENMP, "-c", str(SOURCE), "-o", obj)
            run("-shared", *OPENMP, obj, "-o", tmp, "-lm")
        except subprocess.CalledProcessError:
            run(*FLAGS, "-c", str(SOURCE), "-o", obj)
            run("-shared", obj, "-o", tmp, "-lm")
        os.replace(tmp, target)
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)


def _cpu_signature() -> str:
    """The machine and its CPU feature flags (what `-march=native` compiles for)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {flags}"
