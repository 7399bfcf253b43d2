"""Marks for tests of paths that only some CPUs run: oneDNN's bfloat16 kernels need AVX-512
(BW, VL, DQ) or AVX-NE-CONVERT, and these machines are sometimes an AVX2-only AMD EPYC, where
the engine takes torch's matmul for bfloat16 instead (`actors.cpu_linear.onednn_runs`)."""

from __future__ import annotations

import pytest
import torch

from actors.cpu_linear import onednn_runs

ONEDNN_BF16 = onednn_runs(torch.bfloat16)

needs_onednn_bf16 = pytest.mark.skipif(
    not ONEDNN_BF16,
    reason="oneDNN's bfloat16 kernels need AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT",
)

# torch.bfloat16 as a `dtype` parameter of a test of the packed (oneDNN) path
PACKED_BF16 = pytest.param(torch.bfloat16, marks=needs_onednn_bf16, id="bfloat16")
