"""The model's linear layers through oneDNN with prepacked weights, on CPU.

Why by hand: torch's `F.linear` runs float32 on CPU through MKL's sgemm, which on AMD CPUs
takes its AVX2 path even where the CPU has AVX-512: measured on an AMD EPYC (AVX-512, 2 cores)
~200 GFLOP/s against ~490 GFLOP/s for oneDNN's packed linear at the engine's step shapes
(docs/benchmarks-peers.md), and 2.3x faster whole generation. torch ships that oneDNN op
(`torch.ops.mkldnn._linear_pointwise`, with its weight packed once by
`torch.ops.mkldnn._reorder_linear_weight`: what inductor's freezing pass emits), and vLLM's
CPU backend does the same through its own oneDNN handle. bfloat16 already goes to oneDNN in
torch, but repacks the weight every call (packed: ~5-25% less matmul time).

The packed weights are a copy (the model's own parameters stay as they were, so its
`state_dict` and tied embeddings are untouched): a float32 model holds its linear weights
twice. Rounding differs from MKL's as one GEMM's from another's (sums in another order); the
engine's greedy float32 tokens still match Hugging Face `generate` (tests/actors).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from actors import fused_linear

logger = logging.getLogger(__name__)

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# The batch size oneDNN picks its packed layout for: the engine's decode batches (tens to a
# few hundred rows); any other batch size runs on the same layout.
BATCH_HINT = 128


def onednn_available() -> bool:
    """torch was built with oneDNN and has the packed linear ops."""
    built = bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
    return built and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_runs(dtype: torch.dtype) -> bool:
    """oneDNN's packed linear ops run `dtype` on this CPU. Its bfloat16 path needs AVX-512
    (BW, VL, DQ) or AVX-NE-CONVERT, which torch itself checks (inductor asks the same op):
    on an AVX2-only CPU `_reorder_linear_weight` raises for a bfloat16 weight (an AMD EPYC
    7xx3, 2026-11-28), and torch's own matmul, which emulates it, is what runs there."""
    if not onednn_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve(choice: str, device: torch.device, dtype: torch.dtype, copy_bytes: int = 0) -> str:
    """`EngineConfig.linear_backend` for this engine: "onednn" or "torch". `auto` keeps torch's
    linear when the packed copy (`copy_bytes`) would take more than half the memory free now:
    a user's large model on a CPU box must load, faster or not."""
    if choice == "torch":
        return "torch"
    usable = device.type == "cpu" and dtype in PACKED_DTYPES and onednn_runs(dtype)
    if choice == "onednn" and not usable:
        raise ValueError(
            f"linear_backend='onednn' needs a CPU model in float32 or bfloat16 (bfloat16 on "
            f"a CPU with AVX-512 or AVX-NE-CONVERT) and torch with oneDNN; got "
            f"{device.type} {dtype}"
        )
    if choice == "auto" and usable and copy_bytes > free_memory_bytes() // 2:
        logger.warning(
            "linear layers stay on torch's matmul: their packed oneDNN copy (%.1f GB) would "
            "take more than half the free memory (%.1f GB); linear_backend='onednn' forces it",
            copy_bytes / 1e9,
            free_memory_bytes() / 1e9,
        )
        return "torch"
    return "onednn" if usable else "torch"


def linear_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights `pack_linears` would copy."""
    return sum(
        m.weight.numel() * m.weight.element_size()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m.weight.dtype in PACKED_DTYPES
    )


def free_memory_bytes() -> int:
    """Memory free now (Linux: not counting the page cache it could reclaim; so on the low
    side), or a large number where the OS does not say."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def pack_linears(model: torch.nn.Module, fuse: bool = True) -> int:
    """Route every `nn.Linear` of `model` through oneDNN with its weight packed once; returns
    how many. With `fuse`, sibling projections of one input (q/k/v, gate/up) share one packed
    matmul (actors/fused_linear.py). A layer already packed is left as it is (an engine
    built twice on one model)."""
    count = 0
    if fuse:
        for members in fused_linear.fusable_groups(model, PACKED_DTYPES):
            fused_linear.fuse(members, BATCH_HINT)
            count += len(members)
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or hasattr(module, "_raypack_packed"):
            continue
        weight = module.weight.detach()
        if weight.dtype not in PACKED_DTYPES or weight.device.type != "cpu":
            continue
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
        bias = None if module.bias is None else module.bias.detach()
        module._raypack_packed = packed
        module.forward = _packed_forward(packed, bias)  # type: ignore[method-assign]
        count += 1
    logger.info("%d linear layers run through oneDNN with packed weights", count)
    return count


def unpack_linears(model: torch.nn.Module) -> None:
    """Undo `pack_linears`: every linear layer back on its own forward (torch's F.linear)."""
    restore_forwards(model, "_raypack_packed")


def restore_forwards(model: torch.nn.Module, marker: str) -> None:
    """Every module carrying the attribute `marker` (set beside the forward installed on it:
    the packed linear here, the fused layers' in rotary_attention.py and llama_layer.py) back
    on its class's forward, the marker gone."""
    for module in model.modules():
        if hasattr(module, marker):
            delattr(module, marker)
            del module.forward


def _packed_forward(packed: torch.Tensor, bias: torch.Tensor | None) -> Callable[..., Any]:
    op = torch.ops.mkldnn._linear_pointwise

    def forward(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = op(x, packed, bias, "none", [], "")
        return out

    return forward
