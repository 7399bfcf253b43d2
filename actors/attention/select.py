"""Which attention backend an engine runs: chosen once per engine (or parallel worker), from
`EngineConfig.attention_backend` and the device and dtype of its KV cache."""

from __future__ import annotations

from typing import Any

import torch

from actors.attention.base import AttentionBackend, HybridBackend, KVCaches
from actors.attention.gemm_prefill import GemmPrefillBackend
from actors.attention.kernel import KernelDecodeBackend
from actors.attention.sdpa import SdpaDecodeBackend, SdpaPrefillBackend
from actors.attention.shared_prefix import SharedPrefixDecodeBackend
from actors.attention.varlen import VarlenBackend
from actors.config import ATTENTION_BACKENDS
from actors.cpu_linear import onednn_available
from actors.kernels import paged_decode_kernel

HALF = (torch.bfloat16, torch.float16)


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """The backend `name` stands for on `device` in `dtype` ("auto": varlen on CUDA in half
    precision, the C kernel on CPU in float32 or bfloat16 when it builds, else sdpa); a ValueError says
    why a named one cannot run there."""
    device = torch.device(device)
    where = f"{device.type} in {str(dtype).removeprefix('torch.')}"
    if name == "auto":
        if device.type == "cuda" and dtype in HALF:
            return "varlen"
        return "cpu_kernel" if paged_decode_kernel(device, dtype) is not None else "sdpa"
    if name == "varlen" and not (device.type == "cuda" and dtype in HALF):
        raise ValueError(
            "attention_backend 'varlen' needs CUDA in bfloat16 or float16 (flash varlen "
            f"kernels); this engine runs on {where}: use 'auto' or 'sdpa'"
        )
    if name == "cpu_kernel":
        if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                "attention_backend 'cpu_kernel' needs float32 or bfloat16 on CPU; this engine "
                f"runs on "
                f"{where}: use 'auto' or 'sdpa'"
            )
        if paged_decode_kernel(device, dtype) is None:
            raise ValueError(
                "attention_backend 'cpu_kernel': the paged decode kernel could not be built "
                "(no working C compiler, see the warning logged); use 'auto' or 'sdpa'"
            )
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    return name


def available_backends(device: torch.device | str, dtype: torch.dtype) -> list[str]:
    """The named backends (not "auto") that can run on `device` in `dtype` on this machine."""
    usable = []
    for name in ATTENTION_BACKENDS:
        if name == "auto":
            continue
        try:
            resolve_backend(name, device, dtype)
        except ValueError:
            continue
        usable.append(name)
    return usable


def make_backend(
    name: str,
    kv_caches: KVCaches,
    shared_prefix: bool | None = False,
    shared_prefix_min_keys: int = 1,
) -> AttentionBackend[Any]:
    """The backend `name` stands for, over `kv_caches` (whose device and dtype decide); with
    `shared_prefix` (`EngineConfig.shared_prefix_attention`) the C kernel's decodes read
    blocks that decodes share once per step, runs of members x keys >= the minimum
    (`shared_prefix`; the C kernel's float32 and bfloat16: the other backends ignore it; None:
    where the kernel was built with its AVX-512 run tiles, `PagedDecode.tiled_runs`).
    `cpu_kernel` in float32 attends its long prefill segments by oneDNN matrix products
    (`gemm_prefill`); bfloat16 and the `sdpa` backend keep SDPA for them."""
    owned = next(k for k, _ in kv_caches if k.dim() == 4)
    name = resolve_backend(name, owned.device, owned.dtype)
    if name == "varlen":
        return VarlenBackend(kv_caches)
    prefill: AttentionBackend[Any] = SdpaPrefillBackend(kv_caches)
    if name == "cpu_kernel":
        if owned.dtype == torch.float32 and onednn_available():  # its long segments by oneDNN
            prefill = GemmPrefillBackend(kv_caches)
        kernel = paged_decode_kernel(owned.device, owned.dtype)
        assert kernel is not None  # resolve_backend checked
        if kernel.tiled_runs if shared_prefix is None else shared_prefix:
            decode = SharedPrefixDecodeBackend(kv_caches, kernel, shared_prefix_min_keys)
            return HybridBackend(decode, prefill)
        return HybridBackend(KernelDecodeBackend(kv_caches, kernel), prefill)
    return HybridBackend(SdpaDecodeBackend(kv_caches), prefill)
