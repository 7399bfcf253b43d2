"""CPU kernels compiled on first use: the paged decode attention (`paged_decode.c` in float32,
`paged_decode_bf16.c` in bfloat16, each its own library; both include the algorithm from
`paged_decode_attend.h`), and the layers' element-wise kernels (`fused_ops.c`, built with its
own flags by `actors.kernels.fused`).

torch has no paged attention on CPU (its varlen kernel is CUDA only, and IPEX, which has
one, last released for torch 2.8), so raypack ships one small C file and builds it with the
machine's C compiler (`$CC`, else `cc`) into `~/.cache/raypack/kernels`
(`$RAYPACK_CACHE_DIR/kernels`), then calls it through `ctypes` (no torch
headers, so the build takes well under a second). The library is keyed by the source (and
the headers beside it), the flags and the CPU's feature flags, because `-march=native` code
must only run on the CPU it was built for (a home directory shared by unlike nodes keeps one
build per kind of CPU).

When no compiler works, `paged_decode_kernel` logs why once and returns None, and the
engine's "auto" attention backend gathers decode blocks for SDPA instead (`actors.attention`):
slower, the same tokens.
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
SOURCE_BF16 = Path(__file__).with_name("paged_decode_bf16.c")
# The dtypes a kernel exists for: its source and the function the library exports.
KERNELS = {
    torch.float32: (SOURCE, "raypack_paged_decode_lse_f32"),
    torch.bfloat16: (SOURCE_BF16, "raypack_paged_decode_bf16"),
}
# Each library's shared-prefix runs (shared_runs.h), by the same dtype
RUNS = {torch.float32: "raypack_shared_runs_f32", torch.bfloat16: "raypack_shared_runs_bf16"}
RUN_WIDTH = 16  # the runs' head_dim must be a multiple of it (shared_runs.h)
# Compiled with -ffast-math (vectorized expf and float sums) but LINKED without it: a link
# with -ffast-math adds crtfastmath.o (GCC < 13), whose constructor sets flush-to-zero and
# denormals-are-zero for the whole process when the library loads (torch's numerics, and
# hypothesis's float strategies, noticed).
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC")
# OpenMP splits sequences over torch's threads; without it the kernel runs on one thread.
OPENMP = ("-fopenmp",)


class PagedDecode:
    """The compiled `raypack_paged_decode_lse_f32` (or `raypack_paged_decode_bf16` for `dtype`
    bfloat16: query, caches and output in bfloat16, float32 arithmetic), called with torch
    tensors; both can also write each head's log-sum-exp (float32)."""

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        fn = getattr(library, KERNELS[dtype][1])
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, ctypes.c_float]
        fn.argtypes += [i64, ctypes.c_float]  # window (0: none), softcap (0: none)
        fn.argtypes += [ptr, ptr, i64]  # out, lse (NULL: not written), threads
        fn.restype = ctypes.c_int
        self._fn = fn
        runs = getattr(library, RUNS[dtype])
        runs.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, ctypes.c_float]
        runs.argtypes += [ctypes.c_float, ptr, ptr, i64]  # softcap (0: none), out, lse, threads
        runs.restype = ctypes.c_int
        self._runs = runs
        # whether the runs take the AVX-512 tiles (shared_runs.h's RUN_BIG), not the plain path
        self.tiled_runs = bool(library.raypack_shared_runs_tiled())

    def __call__(
        self,
        query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
        seq_lens: torch.Tensor,  # [num_seqs] int64: keys per sequence, its new token included
        scale: float,
        out: torch.Tensor,  # [num_seqs, num_heads, head_dim], written
        lse: torch.Tensor | None = None,  # [num_seqs, num_heads], written when given
        window: int | None = None,  # attend to each sequence's last `window` keys only
        softcap: float | None = None,  # scores become softcap * tanh(score / softcap)
    ) -> None:
        """Attend each sequence's one query to its keys in the paged cache, into `out` (and
        each head's log-sum-exp of its scaled (and capped) scores into `lse`); every
        argument checked (a ValueError names the bad one)."""
        check_cache(k_cache, v_cache, self.dtype)
        check_step(block_tables, seq_lens)
        _check("query", query, self.dtype)
        _check("out", out, self.dtype)
        if out.shape != query.shape or len(query) != len(seq_lens):
            raise ValueError("query, out, block_tables and seq_lens disagree on num_seqs")
        if lse is not None:
            _check("lse", lse, torch.float32)
            if lse.shape != query.shape[:2]:
                raise ValueError("lse must be [num_seqs, num_heads]")
        if query.shape[1] % k_cache.shape[2]:
            raise ValueError("num_heads must be a multiple of kv_heads")
        if (window is not None and window < 1) or (softcap is not None and softcap <= 0):
            raise ValueError(f"window must be >= 1 and softcap > 0, got {window}, {softcap}")
        self.run(query, k_cache, v_cache, block_tables, seq_lens, scale, out, lse, window, softcap)

    def run(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        """`__call__` without the checks, for a caller that made sure of them: the caches
        with `check_cache` once, the step's tables with `check_step` once per step, and
        query and out contiguous, of the same shape and dtype as the caches, lse None or
        contiguous float32 `[num_seqs, num_heads]` (`actors.attention.kernel`,
        `.shared_prefix`)."""
        num_seqs, num_heads, head_dim = query.shape
        if num_seqs == 0:
            return
        _, block_size, kv_heads, _ = k_cache.shape
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
            window or 0,
            softcap or 0.0,
            out.data_ptr(),
            None if lse is None else lse.data_ptr(),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("paged decode attention could not allocate its scratch memory")

    def runs(
        self,
        query: torch.Tensor,  # [rows, head_dim], run by run, each [kv_heads, its rows, dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,  # [num_runs, max_blocks] int64: each run's blocks
        run_keys: torch.Tensor,  # [num_runs] int64: each run's keys
        row_start: torch.Tensor,  # [num_runs + 1] int64: run r's rows in query
        scale: float,
        out: torch.Tensor,  # [rows, head_dim] float32
        lse: torch.Tensor,  # [rows] float32
        softcap: float | None = None,
    ) -> None:
        """Shared-prefix runs (`shared_runs.h`): every query row of run r against the run's
        keys, of its kv head (run r's rows are kv head by kv head), into `out` (float32, not
        rounded to the caches' dtype) and the rows' log-sum-exps into `lse`. Unchecked as
        `run`: the caller makes sure of the shapes, dtypes, contiguity, and of a head_dim
        that is a multiple of `RUN_WIDTH`."""
        _, block_size, kv_heads, head_dim = k_cache.shape
        failed = self._runs(
            query.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            run_keys.data_ptr(),
            row_start.data_ptr(),
            len(run_keys),
            kv_heads,
            head_dim,
            block_size,
            scale,
            softcap or 0.0,
            out.data_ptr(),
            lse.data_ptr(),
            torch.get_num_threads(),
        )
        if failed == 2:
            raise ValueError(f"shared runs need head_dim % {RUN_WIDTH} == 0 and rows per kv head")
        if failed:
            raise MemoryError("shared-prefix runs could not allocate their scratch memory")


def check_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype = torch.float32
) -> None:
    """A layer's K and V caches as the kernel for `dtype` reads them: alike, contiguous
    `dtype` on CPU, `[num_blocks, block_size, kv_heads, head_dim]`."""
    _check("k_cache", k_cache, dtype)
    _check("v_cache", v_cache, dtype)
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "K and V caches must be alike, [num_blocks, block_size, kv_heads, head_dim]; got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )


def check_step(block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """A step's block tables `[num_seqs, max_blocks]` and seq_lens `[num_seqs]`, int64."""
    _check("block_tables", block_tables, torch.int64)
    _check("seq_lens", seq_lens, torch.int64)
    if block_tables.dim() != 2 or len(block_tables) != len(seq_lens):
        raise ValueError("query, out, block_tables and seq_lens disagree on num_seqs")


def _check(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor")


def paged_decode_kernel(device: torch.device | str, dtype: torch.dtype) -> PagedDecode | None:
    """The compiled kernel for float32 or bfloat16 on CPU, else (or when it cannot be built)
    None."""
    if torch.device(device).type != "cpu" or dtype not in KERNELS:
        return None
    library = _load(KERNELS[dtype][0])
    return None if library is None else PagedDecode(library, dtype)


@functools.cache  # one build and load per source and process; a loaded library never changes
def _load(source: Path, flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL | None:
    from actors.loader import cache_dir  # beside the converted models ($RAYPACK_CACHE_DIR)

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    return load_library(compiler, cache_dir() / "kernels", source, flags)


def load_library(
    compiler: str | None, cache_dir: Path, source: Path = SOURCE, flags: tuple[str, ...] = FLAGS
) -> ctypes.CDLL | None:
    """Build `source` (`paged_decode.c`) with `compiler` and `flags` into `cache_dir` unless
    built already, and load it; None (with a warning) when there is no compiler or the build
    fails. (Tests build with `-mno-avx512f` added: the kernels' path for other CPUs.)"""
    if compiler is None:
        logger.warning("no C compiler on PATH: decode attention gathers blocks for SDPA")
        return None
    key = hashlib.sha256()
    headers = sorted(source.parent.glob("*.h"))  # what the source may include
    for part in (source.read_bytes(), *(h.read_bytes() for h in headers)):
        key.update(part)
    for part in (" ".join(flags).encode(), _cpu_signature().encode()):
        key.update(part)
    target = cache_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        try:
            _build(compiler, target, source, flags)
        except (OSError, subprocess.SubprocessError) as exc:
            logger.warning("could not build %s (%s): decode attention gathers blocks", source, exc)
            return None
    return ctypes.CDLL(str(target))


def _build(compiler: str, target: Path, source: Path, flags: tuple[str, ...] = FLAGS) -> None:
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
            run(*flags, *OPENMP, "-c", str(source), "-o", obj)
            run("-shared", *OPENMP, obj, "-o", tmp, "-lm")
        except subprocess.CalledProcessError:
            run(*flags, "-c", str(source), "-o", obj)
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
