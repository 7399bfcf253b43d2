"""A small job's CPU seconds by process: what `raypack generate` on a few rows costs the box.

The suite runs ~35 small jobs on 2 cores, and a user's small job waits for the same start-up:
every CPU second a job's processes spend before and after the engine's steps is wall time on a
busy box (issue 30 item 4, issue 28 item 4). Each run is `raypack generate` on `--rows` Alpaca
chat prompts, `--max-tokens` new tokens, a local Ray started by the command (as
`bench_startup.py`'s job case), while `benchmarks/cpu_share.py`'s sampler reads every
process's user + system CPU from `/proc` every `--interval` seconds. Printed: per process
name (the engine actor is `ray::MapWorker(MapBatches(InferStage))`; Ray's own `gcs_server`,
`raylet`, the dashboard; the command itself `python -m pipeline.commands`), the median over
`--repeats` of its CPU seconds over the run, the total, the job's wall time and its phases.
A process's CPU after the last sample that saw it (at most `--interval`, while it exits) is
not counted.

    python benchmarks/bench_job_cpu.py --repeats 3 --json job_cpu.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/bench_job_cpu.py` from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks._bench_common import emit, machine  # noqa: E402
from benchmarks.bench_startup import job_case  # noqa: E402
from benchmarks.cpu_share import _TICKS, CpuSampler  # noqa: E402

UNNAMED = "kernel or unnamed"  # cpu_share.process_name's for a process without a command line


def cpu_seconds(sampler: CpuSampler, own_pid: int) -> dict[str, float]:
    """CPU seconds each process name used between the sampler's first and last samples
    (processes that started after the first sample count from zero), under the last name it
    had while it had a command line (an exiting process has none); the sampler's own process
    is left out."""
    first = sampler.samples[0][1]
    last_seen: dict[int, tuple[str, int]] = {}
    for _, snap in sampler.samples[1:]:
        for pid, (name, ticks) in snap.items():
            if name == UNNAMED and pid in last_seen:  # an exiting process: keep its name
                name = last_seen[pid][0]
            last_seen[pid] = (name, ticks)
    used: dict[str, float] = defaultdict(float)
    for pid, (name, ticks) in last_seen.items():
        if pid == own_pid:
            continue
        before = first.get(pid)
        spent = ticks - (before[1] if before else 0)
        if spent > 0:
            used[name] += spent / _TICKS
    return dict(used)


def one_run(
    rows: int, work: Path, env: dict[str, str], interval: float, extra: tuple[str, ...]
) -> dict[str, Any]:
    sampler = CpuSampler(interval).start()
    try:
        job = job_case(rows, work, env, extra)
        time.sleep(interval * 2)  # a last sample after the command's exit
    finally:
        sampler.stop()
    by_name = cpu_seconds(sampler, os.getpid())
    return {"job": job, "cpu_s": by_name, "total_cpu_s": sum(by_name.values())}


def summarize(runs: list[dict[str, Any]], min_s: float) -> dict[str, Any]:
    """Medians over the runs: each process name's CPU seconds (names under `min_s` folded
    into `other`), the total, the wall time and the job's phases."""
    names = {n for r in runs for n in r["cpu_s"]}
    med = {n: statistics.median(r["cpu_s"].get(n, 0.0) for r in runs) for n in names}
    shown = {n: round(v, 2) for n, v in sorted(med.items(), key=lambda kv: -kv[1]) if v >= min_s}
    shown["other"] = round(sum(v for n, v in med.items() if v < min_s), 2)
    phases = {
        k: round(statistics.median(r["job"][k] for r in runs), 2)
        for k, v in runs[0]["job"].items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
    return {
        "cpu_s": shown,
        "total_cpu_s": round(statistics.median(r["total_cpu_s"] for r in runs), 2),
        "total_cpu_s_runs": [round(r["total_cpu_s"], 2) for r in runs],
        "wall_s_runs": [r["job"]["wall_s"] for r in runs],
        "job": phases,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--interval", type=float, default=0.2, help="sampling period, s")
    parser.add_argument("--min-s", type=float, default=0.1, help="fold smaller into `other`")
    parser.add_argument("--json", help="write the JSON here too")
    parser.add_argument("flags", nargs="*", help="more `raypack generate` flags (after --)")
    args = parser.parse_args(argv)

    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    work = Path(tempfile.mkdtemp(prefix="bench-job-cpu-"))
    try:
        runs = [
            one_run(args.rows, work, env, args.interval, tuple(args.flags))
            for _ in range(args.repeats)
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "machine": machine(),
        "rows": args.rows,
        "flags": args.flags,
        **summarize(runs, args.min_s),
    }
    emit(result, True, args.json)


if __name__ == "__main__":
    main()
