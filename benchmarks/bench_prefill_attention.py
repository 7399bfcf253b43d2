"""Prefill attention against cached prefixes: oneDNN products (`GemmPrefillBackend`) against
SDPA per segment (`SdpaPrefillBackend`, torch's CPU flash kernel), one layer's call, float32.

Shapes of the prefix set (benchmarks/peer_docs.py: 8 documents of ~1,000 tokens x 16
questions, SmolLM2-135M: 9 query heads over 3 kv heads of dim 64): a document's 512-token
chunk against its cached first part, a shorter chunk, a fresh 85-token chat prompt, and a
124-row extend; the cache's blocks shuffled as the allocator hands them out. Both backends
are timed interleaved, the median of `--repeats` calls of each; prints JSON with the machine.

    /tmp/b.sh timeout 600 python benchmarks/bench_prefill_attention.py --json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import _bench_common as common
import numpy as np
import torch

from actors.attention import AttentionBackend, LayerAttention, StepBatch
from actors.attention.gemm_prefill import GemmPrefillBackend
from actors.attention.sdpa import SdpaPrefillBackend
from packing.layout import flat_layout

BLOCK = 16
CASES = [(568, 512), (716, 407), (0, 85), (1000, 124), (1080, 22)]  # (cached, new) rows


def timed(
    backend: AttentionBackend[Any], batch: StepBatch, step: tuple[torch.Tensor, ...], repeats: int
) -> float:
    """ms of one layer's forward (median), after one warm-up call."""
    meta = backend.prepare(batch)
    q, k, v, out = step
    params = LayerAttention(scale=0.125)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        backend.forward(meta, 0, q, k, v, params, out)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the JSON result")
    parser.add_argument("--output", help="write the JSON result here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for cached, new in CASES:
        blocks = -(-(cached + new) // BLOCK)
        k_cache = torch.randn(blocks, BLOCK, 3, 64, generator=gen)
        caches = [(k_cache, torch.randn(k_cache.shape, generator=gen))]
        table = torch.randperm(blocks, generator=gen).tolist()
        num_cached, num_new = np.array([cached]), np.array([new])
        batch = StepBatch(
            num_cached, num_new, [table], flat_layout(num_cached, num_new).cu_seqlens_q, 0, BLOCK
        )
        step = (
            torch.randn(1, 9, new, 64, generator=gen),
            torch.randn(1, 3, new, 64, generator=gen),
            torch.randn(1, 3, new, 64, generator=gen),
            torch.empty(new, 9, 64),
        )
        sdpa, gemm = SdpaPrefillBackend(caches), GemmPrefillBackend(caches, min_rows=1)
        ms: dict[str, list[float]] = {"sdpa": [], "gemm": []}
        for _ in range(3):  # interleaved rounds
            ms["sdpa"].append(timed(sdpa, batch, step, args.repeats))
            ms["gemm"].append(timed(gemm, batch, step, args.repeats))
        s, g = statistics.median(ms["sdpa"]), statistics.median(ms["gemm"])
        rows.append({"cached": cached, "new": new, "sdpa_ms": round(s, 3), "gemm_ms": round(g, 3)})
        rows[-1]["speedup"] = round(s / g, 2)
        common.log(str(rows[-1]))
    common.emit({"machine": common.machine(), "cases": rows}, args.json, args.output)


if __name__ == "__main__":
    main()
