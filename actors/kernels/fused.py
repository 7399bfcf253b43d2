"""The Llama layer's element-wise work as compiled one-pass kernels (`fused_ops.c`): residual
add + RMSNorm, and rotary on q and k in place, in float32 and bfloat16.

Built and loaded like the decode attention kernel (`actors.kernels`: C compiled on first use
with the machine's flags, called through ctypes) but with its own flags: no -ffast-math and
no FMA contraction, because each result must round exactly where torch's op sequence rounds
(the layer stays bit-identical to transformers'). The norm's sum of squares follows torch's
CPU summation order, which depends on the width of the vectors torch's sum kernel runs
with; `FusedOps.norm_lanes` finds that width by comparing the kernel with torch's own ops on
probe rows of a given width, and a caller uses the fused norm only where one matches (a torch
whose sum adds in another order keeps torch's norm).

Unchecked calls: the caller (actors/llama_layer.py, actors/rotary_attention.py) makes sure
of dtypes, contiguity and shapes, and falls back to torch's ops otherwise.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from actors import kernels

SOURCE = Path(__file__).with_name("fused_ops.c")
# No -ffast-math (it would reorder the sums and approximate 1/sqrt), no FMA (torch's
# separate multiply and add round twice).
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC")
DTYPES = (torch.float32, torch.bfloat16)
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


class FusedOps:
    """The compiled kernels for one dtype, called with torch tensors."""

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._norms = {d: _norm_function(library, d) for d in DTYPES}
        rotary = getattr(library, f"raypack_rotary_{_SUFFIX[dtype]}")
        rotary.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64]
        rotary.restype = ctypes.c_int
        self._rotary = rotary
        self._lanes: dict[tuple[int, float], int | None] = {}
        argmax = library.raypack_argmax_bf16
        argmax.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64]
        argmax.restype = ctypes.c_int
        self._argmax_bf16 = argmax

    def rms_norm(
        self,
        x: torch.Tensor,  # [..., width], contiguous; with residual, becomes x + residual
        weight: torch.Tensor,  # [width]
        eps: float,
        lanes: int,  # `norm_lanes(width, eps)`
        residual: torch.Tensor | None = None,  # like x
    ) -> torch.Tensor:
        """transformers' `LlamaRMSNorm(x) * weight` (after `x += residual` in place when a
        residual is given), a fresh tensor like x."""
        return _norm(self._norms[x.dtype], x, weight, eps, lanes, residual)

    def rotary(
        self,
        qk: torch.Tensor,  # [tokens, row width] (rows contiguous), its first heads written
        heads: int,
        head_dim: int,
        cos: torch.Tensor,  # [tokens, head_dim] contiguous
        sin: torch.Tensor,  # [tokens, head_dim] contiguous
    ) -> None:
        """Rotate the first `heads` heads of each row of `qk` in place (transformers'
        `apply_rotary_pos_emb` on q and k)."""
        self._rotary(
            qk.data_ptr(),
            qk.stride(0),
            cos.numel() // head_dim,
            heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            torch.get_num_threads(),
        )

    def argmax(self, logits: torch.Tensor) -> torch.Tensor | None:
        """`logits.float().argmax(-1)` of bfloat16 `[rows, vocab]` logits (unit stride along
        the vocabulary) in one pass without the float32 copy; None for other logits."""
        if logits.dtype != torch.bfloat16 or logits.dim() != 2 or logits.stride(-1) != 1:
            return None
        rows, cols = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        if rows and cols:
            self._argmax_bf16(
                logits.data_ptr(),
                rows,
                cols,
                logits.stride(0),
                out.data_ptr(),
                torch.get_num_threads(),
            )
        return out if cols else None

    def norm_lanes(self, width: int, eps: float) -> int | None:
        """The vector width with which the fused norm gives torch's bits on probe rows of
        `width`: torch's sum adds in `lanes`-wide vectors, whose width is not always that of
        the CPU capability torch reports (its sum kernel is not built for AVX-512). None: no
        width matches, keep torch's norm (cached)."""
        key = (width, eps)
        if key not in self._lanes:
            found = [n for n in _LANE_CANDIDATES if _norm_matches(self, width, eps, n)]
            self._lanes[key] = found[0] if found else None
        return self._lanes[key]


_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64
_LANE_CANDIDATES = (8, 16, 4)  # AVX2 / NEON / default, AVX-512, SSE-like


def _norm_function(library: ctypes.CDLL, dtype: torch.dtype) -> Any:
    norm = getattr(library, f"raypack_rms_norm_{_SUFFIX[dtype]}")
    scratch = [_PTR] if dtype == torch.bfloat16 else []  # the widened rows
    norm.argtypes = [_PTR, _PTR, _PTR, _PTR, *scratch, _I64, _I64, ctypes.c_float, _I64, _I64]
    norm.restype = ctypes.c_int
    return norm


def _norm(
    function: Any,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    lanes: int,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    width = x.shape[-1]
    out = torch.empty_like(x)
    args = [x.data_ptr(), None if residual is None else residual.data_ptr()]
    args += [weight.data_ptr(), out.data_ptr()]
    wide = None  # held until the call returns
    if x.dtype == torch.bfloat16:
        wide = torch.empty(x.shape, dtype=torch.float32)
        args.append(wide.data_ptr())
    function(*args, x.numel() // width, width, eps, lanes, torch.get_num_threads())
    del wide
    return out


def _norm_matches(ops: FusedOps, width: int, eps: float, lanes: int) -> bool:
    """In float32 (where no rounding to bfloat16 hides a sum in another order) and in the
    ops' dtype: x += residual, then the norm, the same bits as transformers' ops."""
    generator = torch.Generator().manual_seed(width)
    scales = torch.tensor([1e-3, 1.0, 30.0, 1e3])[:, None, None]
    for dtype in dict.fromkeys((torch.float32, ops.dtype)):
        x = (torch.randn(4, 4, width, generator=generator) * scales).reshape(16, width)
        x = x.to(dtype)
        residual = torch.randn(16, width, generator=generator).to(dtype)
        weight = torch.randn(width, generator=generator).to(dtype)
        expected_sum = x + residual
        wide = expected_sum.to(torch.float32)
        variance = wide.pow(2).mean(-1, keepdim=True)
        expected = weight * (wide * torch.rsqrt(variance + eps)).to(dtype)
        got = _norm(ops._norms[dtype], x, weight, eps, lanes, residual)  # x becomes the sum
        if not (torch.equal(got, expected) and torch.equal(x, expected_sum)):
            return False
    return True


def fused_ops(device: torch.device | str, dtype: torch.dtype) -> FusedOps | None:
    """The kernels for float32 or bfloat16 on CPU; None for any other dtype or device, or
    when the library cannot be built."""
    if torch.device(device).type != "cpu" or dtype not in DTYPES:
        return None
    library = kernels._load(SOURCE, FLAGS)
    return None if library is None else FusedOps(library, dtype)
