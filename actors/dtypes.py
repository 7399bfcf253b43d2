"""The dtype an engine runs in: `auto` picks what the hardware really has.

bfloat16 is fast only where the hardware computes it natively: a GPU, or a CPU with
AVX-512 BF16 or AMX (oneDNN's bf16 kernels). Elsewhere torch emulates it through float32
conversions, and an engine in bfloat16 ran at 0.21x its float32 throughput on an AMD EPYC
with AVX2 and no AVX-512 (issue 28), while a CPU with AVX-512 BF16 ran it at ~3x
(docs/benchmarks.md). So `auto` is bfloat16 on CUDA and on such CPUs, float32 elsewhere.
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from actors.config import DTYPE_NAMES

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# CPU flags (as /proc/cpuinfo spells them) under which oneDNN computes bfloat16 natively.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# The ISA flags benchmarks print beside their figures (what decides a CPU's speed here).
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
_MEASURED_EMULATED = "0.21x float32 throughput on an AVX2 CPU without it"


@dataclass(frozen=True)
class CpuInfo:
    """The CPU's model name and its feature flags."""

    model_name: str
    flags: frozenset[str]

    @property
    def native_bf16(self) -> bool:
        """Whether bfloat16 matrix multiplies run natively (not emulated) on this CPU."""
        return any(flag in self.flags for flag in NATIVE_BF16_FLAGS)

    def isa(self) -> dict[str, bool]:
        """The flags that matter for speed, each present or not (for benchmark reports)."""
        return {flag: flag in self.flags for flag in ISA_FLAGS}


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    """This machine's CPU (Linux's /proc/cpuinfo; elsewhere the platform's name, no flags)."""
    fallback = platform.processor() or platform.machine()
    try:
        text = cpuinfo.read_text()
    except OSError:
        return CpuInfo(fallback, frozenset())
    model, flags = "", ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = value
    model = model or fallback
    return CpuInfo(model, frozenset(flags.split()))


def choose_dtype(requested: str, device: str, cpu: CpuInfo) -> tuple[str, str]:
    """The dtype name to run in and why, for `requested` (one of DTYPE_NAMES) on `device`."""
    if requested not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {requested!r}")
    if requested != "auto":
        return requested, "asked for"
    if device.startswith("cuda"):
        return "bfloat16", "auto: a CUDA device"
    if cpu.native_bf16:
        native = [flag for flag in NATIVE_BF16_FLAGS if flag in cpu.flags]
        return "bfloat16", f"auto: the CPU computes bfloat16 natively ({', '.join(native)})"
    return "float32", "auto: the CPU has no native bfloat16 (no avx512_bf16 or amx_bf16)"


def resolve_dtype(requested: str, device: str, cpu: CpuInfo | None = None) -> torch.dtype:
    """`choose_dtype`, logged once per call (one engine), with a warning when bfloat16 is asked
    for on a CPU that would emulate it."""
    cpu = cpu if cpu is not None else cpu_info()
    name, reason = choose_dtype(requested, device, cpu)
    if name == "bfloat16" and device.startswith("cpu") and not cpu.native_bf16:
        logger.warning(
            "dtype bfloat16 on a CPU without native bfloat16 (%s has no avx512_bf16 or "
            "amx_bf16): torch emulates it, measured at %s; --dtype auto picks float32 here",
            cpu.model_name,
            _MEASURED_EMULATED,
        )
    else:
        logger.info("dtype %s (%s)", name, reason)
    import torch  # here: `choose_dtype` and `cpu_info` (the job's driver) need no torch

    dtype: torch.dtype = getattr(torch, name)
    return dtype
