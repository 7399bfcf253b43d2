"""Where a machine's CPU goes over a window: every process's CPU seconds (Linux `/proc`),
sampled by a thread, summed by process name.

`benchmarks/bench_job.py --cpu-shares` uses it for the cores each process held while the job's
engine stepped: on a 2-core box the engine's torch threads want both cores, so whatever Ray's
own processes and the pipeline's other actors take there comes out of the engine's steps.
Samples are taken on `time.perf_counter` (CLOCK_MONOTONIC: one clock for every process of the
machine), so a window can be given in another process's timestamps.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_name(cmdline: bytes, pid: int, own_pid: int) -> str:
    """A short name for a process from its command line: Ray's worker titles as they are
    (`ray::MapWorker(MapBatches(InferStage))`), a script by its file name, else the program."""
    if pid == own_pid:
        return "driver (this benchmark)"
    args = [a.decode(errors="replace") for a in cmdline.split(b"\0") if a]
    if not args:
        return "kernel or unnamed"
    first = args[0]
    if first.startswith("ray::"):
        return first.split(" ")[0].removesuffix(".submit")
    prog = Path(first.split(" ")[0]).name
    if prog.startswith("python") and len(args) > 1:
        rest = iter(args[1:])
        for arg in rest:
            if arg == "-c":  # a command: its text is no name
                return "python -c"
            if arg == "-m":
                return f"python -m {next(rest, '')}".rstrip()
            if not arg.startswith("-"):
                return f"python {Path(arg).name}"
    return prog


def snapshot(own_pid: int) -> dict[int, tuple[str, int]]:
    """pid -> (name, CPU ticks so far: user + system) of every process now."""
    out: dict[int, tuple[str, int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            cmdline = Path(entry.path, "cmdline").read_bytes()
        except OSError:  # the process ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after the name, which may hold spaces
        pid = int(entry.name)
        out[pid] = (process_name(cmdline, pid, own_pid), int(fields[11]) + int(fields[12]))
    return out


class CpuSampler:
    """Snapshots every `interval` seconds in a daemon thread, from `start` to `stop`."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self.samples: list[tuple[float, dict[int, tuple[str, int]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def start(self) -> CpuSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        own = os.getpid()
        while True:
            self.samples.append((time.perf_counter(), snapshot(own)))
            if self._stop.wait(self.interval):
                return

    def cores_between(self, start: float, end: float) -> dict[str, float]:
        """Cores each process name held on average from the first sample at or after `start`
        to the last at or before `end` (largest first; {} when the window holds < 2 samples).
        A process that started inside the window counts from zero, one that ended inside it up
        to the last sample that saw it; one that renamed itself (a Ray worker taking an
        actor's title) counts under its last name."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return {}
        (t0, first), t1 = inside[0], inside[-1][0]
        last_seen: dict[int, tuple[str, int]] = {}
        for _, snap in inside[1:]:
            last_seen.update(snap)
        cores: dict[str, float] = defaultdict(float)
        for pid, (name, ticks) in last_seen.items():
            before = first.get(pid)
            used = ticks - (before[1] if before else 0)
            if used > 0:
                cores[name] += used / _TICKS / (t1 - t0)
        return {k: round(v, 3) for k, v in sorted(cores.items(), key=lambda kv: -kv[1])}
