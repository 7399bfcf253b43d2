"""The job's fixed costs, timed (issue 28 item 4): from the command's start to the engines'
first step, and from their last step to the exit.

Marks are wall-clock times (`time.time()`), so the driver and the engine actors of one
machine share one clock; on a cluster each node's clock is taken to agree with the driver's
within the phases' precision (NTP keeps them to milliseconds). The driver marks its own
milestones on a `JobClock`; each engine actor sends its own (`EngineMarks`) to the job's
`StatsCollector`, which keeps the earliest start and the latest last step over the actors.

The phases, in seconds (a phase whose marks are missing is left out, e.g. `imports` and
`ray_start` when `run_job` is called by a library on a running Ray):

    imports       the process's start -> the command's code runs (Python, our imports)
    check         -> input, model and output checked, the output folder claimed
    ray_start     -> Ray connected (a local one started)
    read_plan     the job's start -> the last partition planned (read, ids, tokenize, plan)
    engine_start  the job's start -> an engine actor's constructor runs (Ray starts the
                  actor's process, which imports torch and transformers), in two parts:
    engine_process  the job's start -> the actor's process started (0 when Ray gave it a
                  worker started earlier)
    engine_imports  -> its constructor runs: Ray's worker start-up, Ray Data's, the stage's
                  module and its arguments unpickled
    engine_load   -> its engine is loaded (torch, transformers' modeling and the engine
                  imported, the model, the KV pool)
    first_step    the later of the two above -> the first engine step starts
    to_first_step the process's start (else the job's) -> the first engine step
    steps         the first step's start -> the last step's end
    last_write    the last step's end -> the output written (the last shard's file)
    report        -> the summary and `_report.png` written
    shutdown      -> Ray's shutdown by the command, after the summary and report (not in
                  `_summary.json`: it comes after; pipeline/commands/shutdown.py)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


def process_start() -> float | None:
    """This process's start as a `time.time()` value, from /proc (Linux); None elsewhere.
    Hand-written: psutil is not among our dependencies for this one number."""
    try:
        with open("/proc/self/stat") as f:
            # the command name (field 2) may hold spaces: count fields after its ")"
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime, field 22
    except (OSError, StopIteration, IndexError, ValueError):
        return None


@dataclass
class EngineMarks:
    """One engine actor's marks (`time.time()`; None until they happen)."""

    process: float | None = None  # its process started (process_start)
    constructed: float | None = None  # its stage's constructor started
    loaded: float | None = None  # its engine loaded
    first_step: float | None = None  # its first step started
    last_step: float | None = None  # its latest step ended

    def merged(self, other: EngineMarks) -> EngineMarks:
        """The job's view over two actors: the earliest start, first step and load, the
        latest last step (the job waits for its last engine)."""

        def first(a: float | None, b: float | None) -> float | None:
            return min((x for x in (a, b) if x is not None), default=None)

        return EngineMarks(
            process=first(self.process, other.process),
            constructed=first(self.constructed, other.constructed),
            loaded=first(self.loaded, other.loaded),
            first_step=first(self.first_step, other.first_step),
            last_step=max(
                (x for x in (self.last_step, other.last_step) if x is not None), default=None
            ),
        )


class JobClock:
    """The driver's marks: `start` (the process's start, or when the clock was made),
    then `command`, `checked`, `ray_up`, `job`, `planned`, `written`, `reported` as the
    job reaches them (`mark`)."""

    def __init__(self, start: float | None = None) -> None:
        self.marks: dict[str, float] = {"start": start or process_start() or time.time()}

    def mark(self, name: str, at: float | None = None) -> None:
        """Record `name` now (or at `at`)."""
        self.marks[name] = time.time() if at is None else at

    def phases(self, engine: EngineMarks | None = None) -> dict[str, float]:
        """The phases (module docstring) these marks and the engines' give, in seconds."""
        m = dict(self.marks)
        if engine is not None:
            for name in ("process", "constructed", "loaded", "first_step", "last_step"):
                value = getattr(engine, name)
                if value is not None:
                    m[f"engine_{name}"] = value
        out: dict[str, float] = {}

        def span(name: str, begin: str, end: str) -> None:
            if begin in m and end in m:
                out[name] = round(max(0.0, m[end] - m[begin]), 2)

        span("imports", "start", "command")
        span("check", "command", "checked")
        span("ray_start", "checked", "ray_up")
        span("read_plan", "job", "planned")
        span("engine_start", "job", "engine_constructed")
        span("engine_process", "job", "engine_process")
        span("engine_imports", "engine_process", "engine_constructed")
        span("engine_load", "engine_constructed", "engine_loaded")
        if "planned" in m and "engine_loaded" in m:
            m["ready"] = max(m["planned"], m["engine_loaded"])
            span("first_step", "ready", "engine_first_step")
        span("to_first_step", "start" if "command" in m else "job", "engine_first_step")
        span("steps", "engine_first_step", "engine_last_step")
        span("last_write", "engine_last_step", "written")
        span("report", "written", "reported")
        return out


def phases_line(phases: dict[str, float]) -> str:
    """The phases as the command prints them: one line, the start-up's parts and the tail's
    (empty when there are none)."""

    def parts(names: tuple[tuple[str, str], ...]) -> str:
        return ", ".join(f"{label} {phases[k]:.1f}" for k, label in names if k in phases)

    start = parts(
        (
            ("imports", "imports"),
            ("check", "check"),
            ("ray_start", "Ray"),
            ("read_plan", "read+plan"),
            ("engine_start", "engine start"),
            ("engine_load", "load"),
            ("first_step", "first step"),
        )
    )
    tail = parts((("last_write", "write"), ("report", "report"), ("shutdown", "shutdown")))
    out = []
    if "to_first_step" in phases:
        out.append(f"first step at {phases['to_first_step']:.1f}s ({start})")
    if "steps" in phases:
        out.append(f"steps {phases['steps']:.1f}s")
    if tail:
        out.append(f"then {tail}")
    return "; ".join(out)
