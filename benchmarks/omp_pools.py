"""What a second OpenMP thread pool costs an engine's thread (pipeline/stages/feed.py).

GNU OpenMP (torch's CPU threads in the pip wheels) keeps a pool of threads per thread that
starts parallel regions. The job's engine actor once loaded its model in the constructor's
thread and stepped it in the feed thread: two pools. When their threads outnumber the
machine's cores, idle ones sleep instead of spinning, and each parallel region waits for a
wake-up. This runs the same loop of small ops (a step's element-wise work: a [165, 576]
float32 multiply and add) and of linears ([165, 576] x [576, 1536]) in a worker thread, in
a fresh process each, with and without a parallel region run first in the main thread (the
baseline), and prints JSON: seconds per case, the ratio, the CPU and its ISA flags.

    python benchmarks/omp_pools.py --threads 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/omp_pools.py` from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks._bench_common import emit, machine  # noqa: E402

CASES = ("one_pool", "two_pools")


def _case(name: str, threads: int) -> dict[str, float]:
    """In this (fresh) process: the loops in a worker thread, after the main thread started
    its own pool (`two_pools`) or not (`one_pool`)."""
    import torch

    torch.set_num_threads(threads)
    small = torch.randn(165, 576)
    if name == "two_pools":
        for _ in range(10):
            small.mul(1.5)  # a parallel region (> torch's grain of 32,768 elements)
    x, w = torch.randn(165, 576), torch.randn(1536, 576)
    result: dict[str, float] = {}

    def run() -> None:
        torch.set_num_threads(threads)
        for _ in range(200):
            torch.nn.functional.linear(x, w)
        t = time.perf_counter()
        for _ in range(10_000):
            small.mul(1.5).add_(1.0)
        result["small_ops_s"] = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(2_000):
            torch.nn.functional.linear(x, w)
        result["linears_s"] = time.perf_counter() - t

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--json", help="write the JSON report to this file (too)")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(_case(args.case, args.threads)))
        return
    runs: dict[str, list[dict[str, float]]] = {case: [] for case in CASES}
    for _ in range(args.repeats):  # alternating, each in a fresh process
        for case in CASES:
            cmd = [sys.executable, __file__, "--case", case, "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
            runs[case].append(json.loads(out.stdout.strip().splitlines()[-1]))
    medians = {
        case: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        for case, rs in runs.items()
    }
    report = {
        "machine": machine(),
        "threads": args.threads,
        "runs": runs,
        "median_s": medians,
        "two_pools_over_one": {
            key: medians["two_pools"][key] / medians["one_pool"][key] for key in medians["one_pool"]
        },
    }
    emit(report, True, args.json)


if __name__ == "__main__":
    main()
