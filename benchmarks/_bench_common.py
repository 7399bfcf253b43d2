"""Shared pieces of the benchmarks: real prompts, interleaved timing, FLOP/s and peak memory.

Timing on a shared 2-core machine swings 2-3x from run to run, so every benchmark times its
methods interleaved (A, B, C, then A, B, C again, with the order rotated each repetition) and
reports medians; ratios are only taken between methods of the same run.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gzip
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/bench_*.py` from anywhere
    sys.path.insert(0, str(ROOT))

from actors.dtypes import choose_dtype, cpu_info  # noqa: E402 (after the path line above)

DATA_DIR = Path(os.environ.get("RAYPACK_DATA_DIR", ROOT.parent / "shared" / "data"))
ALPACA_FILE = "alpaca_5000.json"
HH_FILE = "hh_rlhf_harmless_base_test.jsonl.gz"
DATASETS = ("alpaca", "hh")


def setup_torch(threads: int) -> None:
    """Fix the thread count (the machine's cores; more only adds OpenMP hand-offs)."""
    torch.set_num_threads(threads)


def alpaca_prompts(tokenizer: Any, data_dir: Path = DATA_DIR) -> list[list[int]]:
    """Alpaca instruction (plus input, when present) as one user turn through the model's chat
    template with the generation prompt, as token ids."""
    with open(data_dir / ALPACA_FILE) as f:
        records = json.load(f)
    out = []
    for record in records:
        content = record["instruction"]
        if record.get("input"):
            content += "\n\n" + record["input"]
        # transformers 5 returns a BatchEncoding when tokenize=True; render text, then encode.
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        out.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return out


def hh_prompts(tokenizer: Any, data_dir: Path = DATA_DIR) -> list[list[int]]:
    """HH-RLHF `chosen` dialogues (the whole Human/Assistant transcript), as token ids."""
    with gzip.open(data_dir / HH_FILE, "rt") as f:
        texts = [json.loads(line)["chosen"] for line in f if line.strip()]
    return [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]


def load_prompts(name: str, tokenizer: Any, data_dir: Path = DATA_DIR) -> list[list[int]]:
    """Token ids of every prompt of dataset `name` ("alpaca" or "hh")."""
    if name == "alpaca":
        return alpaca_prompts(tokenizer, data_dir)
    if name == "hh":
        return hh_prompts(tokenizer, data_dir)
    raise ValueError(f"dataset must be one of {DATASETS}, got {name!r}")


def sample(prompts: Sequence[list[int]], count: int, seed: int) -> list[list[int]]:
    """`count` distinct prompts drawn at random with a fixed seed."""
    rng = np.random.default_rng(seed)
    return [prompts[int(i)] for i in rng.choice(len(prompts), size=count, replace=False)]


@dataclass
class Timings:
    """Wall and CPU seconds of one method's runs.

    On a shared machine a run's wall time includes the time it was descheduled (single runs
    swing 2-5x here); the process CPU time (all its threads) counts only the work it did, so
    with one torch thread it is the steadier measure of compute. Both are reported.
    """

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Medians, minima and the runs."""
        return {
            "median_wall_s": median(self.wall),
            "median_cpu_s": median(self.cpu),
            "min_wall_s": min(self.wall),
            "min_cpu_s": min(self.cpu),
            "runs_wall_s": [round(t, 4) for t in self.wall],
            "runs_cpu_s": [round(t, 4) for t in self.cpu],
        }


def interleaved(
    methods: dict[str, Callable[[], Any]], repeats: int, log: Callable[[str], None] | None = None
) -> dict[str, Timings]:
    """Time each method `repeats` times, interleaved with a rotating order so a slow stretch
    of the machine hits every method alike."""
    names = list(methods)
    times = {name: Timings() for name in names}
    for rep in range(repeats):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            wall, cpu = time.perf_counter(), time.process_time()
            methods[name]()
            times[name].wall.append(time.perf_counter() - wall)
            times[name].cpu.append(time.process_time() - cpu)
            if log is not None:
                log(
                    f"  rep {rep + 1}/{repeats} {name}: {times[name].wall[-1]:.3f} s wall, "
                    f"{times[name].cpu[-1]:.3f} s cpu"
                )
    return times


def median(values: Sequence[float]) -> float:
    """The median (of timings)."""
    return float(statistics.median(values))


class MatmulProbe:
    """The machine's practical fp32 peak: FLOP/s of a large square matmul, by wall and by CPU
    time. Call it between the timed methods (the load of a shared machine changes by the
    minute); `flops(clock)` is the median of the measurements."""

    def __init__(self, size: int = 2048, repeats: int = 3) -> None:
        self.a = torch.randn(size, size)
        self.b = torch.randn(size, size)
        self.repeats = repeats
        self.samples: dict[str, list[float]] = {"wall": [], "cpu": []}
        torch.mm(self.a, self.b)  # warm up

    def __call__(self) -> None:
        """Measure once more: the best of `repeats` matmuls, per clock."""
        best = {"wall": float("inf"), "cpu": float("inf")}
        for _ in range(self.repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            torch.mm(self.a, self.b)
            best["wall"] = min(best["wall"], time.perf_counter() - wall)
            best["cpu"] = min(best["cpu"], time.process_time() - cpu)
        for clock, seconds in best.items():
            self.samples[clock].append(2 * self.a.shape[0] ** 3 / max(seconds, 1e-9))

    def flops(self, clock: str) -> float:
        """Median FLOP/s so far by `clock` ("wall" or "cpu")."""
        return median(self.samples[clock])


# ---- peak memory --------------------------------------------------------------------------

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def memory_mode() -> None:
    """Make process RSS follow live tensor memory: large blocks come from mmap and go back
    at free (glibc otherwise keeps freed heap memory, and a later peak would reuse it
    unseen). Slower allocations, so call it only after the timings."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 256 * 1024)
        libc.mallopt(_M_TRIM_THRESHOLD, 1024 * 1024)
    except OSError:  # not glibc: peaks are still measured, less tightly
        pass


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_memory(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run `fn`; its result and the peak resident memory above the start, in bytes.

    Linux resets the high-water mark (VmHWM) when "5" is written to /proc/self/clear_refs, so
    the peak is exact for resident memory, with no sampling thread.
    """
    _malloc_trim()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    result = fn()
    return result, max(0, _status_kib("VmHWM") - before) * 1024


def machine() -> dict[str, Any]:
    """What the numbers were measured on: the CPU's model and the ISA flags that decide its
    speed (bfloat16 is native only with avx512_bf16 or AMX: never compare across machines),
    and the load average (the machine is shared)."""
    cpu = cpu_info()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "cpu": cpu.model_name,
        "isa": cpu.isa(),
        "auto_dtype": choose_dtype("auto", "cpu", cpu)[0],
        "loadavg": list(os.getloadavg()),
    }


def emit(result: dict[str, Any], as_json: bool, path: str | None) -> None:
    """Write the result as JSON (to `path`, or stdout with --json)."""
    text = json.dumps(result, indent=2)
    if path:
        Path(path).write_text(text + "\n")
    if as_json:
        print(text)


def log(message: str) -> None:
    """Progress on stderr (stdout carries the JSON)."""
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def held(lock: str | None) -> Iterator[None]:
    """Hold `lock`'s flock for the block, so timed work never overlaps another benchmark or
    test run that takes the same lock (nothing without a path)."""
    if lock is None:
        yield
        return
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
