"""What a job command prints: raypack's own one-line milestones at INFO, libraries at WARNING,
no progress tables of Ray Data (our own progress line instead: pipeline/job/progress.py), and
each of the messages a clean run used to print either fixed where it comes from or silenced
here with the reason. `--verbose` brings Ray Data's tables and the libraries' INFO back.

Process-wide settings (logging levels, warning filters, environment for the workers a local
Ray starts) belong to the command that owns the process, so only the CLI calls
`quiet_command`; the library and the processor never do.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# Read by pipeline/stages/logs.py in the Ray workers (a local Ray's workers inherit the driver's
# environment), so the engine actors' lines follow --log-level too.
LOG_LEVEL_ENV = "RAYPACK_LOG_LEVEL"
OURS = ("pipeline", "actors", "packing", "raypack")
TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"

# Lines of Ray's C++ core worker on the driver's stderr (not Python logging) that a clean run
# prints and that say nothing is wrong; dropped by `filter_stderr`.
HARMLESS_STDERR = (
    # Ray Data passes an actor pool's UDF and DataContext to its actors by ObjectRef
    # (map_operator.py `_map_transformer_ref`, always ray.put) and its pools restart actors;
    # the driver holds those refs until the operator ends, so a restart finds them
    # (ray-project/ray#53727 is about refs that go out of scope). Not ours to change.
    re.compile(r"core_worker\.cc:\d+: Actor with class name: .* has constructor arguments in "),
    # The raylet (forwarded to the driver's stderr as "(raylet) WARNING") when more than 4 x
    # num_cpus worker processes start at once: the job's tokenizer and engine actors and its
    # write tasks take fractions of a CPU by design (pipeline/stages/engine_actor.py,
    # pipeline/io/writer.py), so a busy node starts that many; nothing is wrong and nothing is
    # the user's to change.
    re.compile(r"PYTHON worker processes have been started on node: .*maximum expected startup"),
)


@dataclass(frozen=True)
class ConsoleOptions:
    """The job command's console flags."""

    log_level: str = "INFO"  # raypack's own loggers; libraries get WARNING unless verbose
    verbose: bool = False  # Ray Data's progress tables and the libraries' INFO lines
    progress: bool = True  # our progress bar / line (pipeline/job/progress.py)
    progress_interval_s: float | None = None  # None: 1 s on a terminal, 10 s otherwise
    dry_run: bool = False  # print the plan and an estimate instead (pipeline/job/dry_run.py)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ConsoleOptions:
        """The options the flags of `add_console_flags` set (defaults when absent)."""
        return cls(
            log_level=getattr(args, "log_level", cls.log_level),
            verbose=getattr(args, "verbose", cls.verbose),
            progress=not getattr(args, "no_progress", False),
            progress_interval_s=getattr(args, "progress_interval", None),
            dry_run=getattr(args, "dry_run", False),
        )


def add_console_flags(parser: argparse.ArgumentParser) -> None:
    """--dry-run, --log-level, --verbose, --no-progress, --progress-interval."""
    g = parser.add_argument_group("console")
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="read and plan, time the engine for a few seconds here, and print what the job "
        "would do (rows, prefix groups and saving, prompt tokens, shards, an engine time "
        "estimate, the plan's picture); no Ray, nothing written",
    )
    g.add_argument(
        "--log-level",
        choices=LEVELS,
        default=ConsoleOptions.log_level,
        type=str.upper,
        help="raypack's own log lines (libraries log warnings only, unless --verbose)",
    )
    g.add_argument(
        "--verbose",
        action="store_true",
        help="also Ray Data's progress tables and the libraries' INFO lines",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar or line")
    g.add_argument(
        "--progress-interval",
        type=float,
        help="seconds between progress lines (default: a live bar on a terminal, else a line "
        "every 10 s)",
    )


def quiet_command(options: ConsoleOptions) -> None:
    """Set up the command's logging and quiet the libraries (see the module docstring)."""
    level = getattr(logging, options.log_level)
    library_level = logging.INFO if options.verbose else logging.WARNING
    logging.basicConfig(level=library_level, format=FORMAT, force=True)
    for name in OURS:
        logging.getLogger(name).setLevel(level)
    os.environ[LOG_LEVEL_ENV] = options.log_level
    if not options.verbose:
        # transformers' (and huggingface_hub's) tqdm bars: loading weights in every engine
        # actor, converting the embedded GGUF once. Read when they are imported, here and in
        # the workers (which inherit this environment).
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        if "transformers" in sys.modules:  # imported already: the variable was read
            sys.modules["transformers"].utils.logging.disable_progress_bar()
    quiet_ray_token_notice()
    # Ray Data warns (once) that its progress bars are off: we turned them off on purpose.
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    # Ray Data warns when a task pool's limit is above the blocks it receives: the writer's
    # limit (pipeline/io/writer.py, two tasks per writer) is a cap for big jobs, and a small job
    # with fewer shards than that simply runs fewer write tasks.
    warnings.filterwarnings(
        "ignore",
        message=r"The maximum number of concurrent tasks for 'MapBatches\(ShardSink",
        category=UserWarning,
    )
    logging.getLogger("ray").setLevel(library_level)


def quiet_ray_token_notice() -> None:
    """Ray's token-authentication notice off, for the job commands and `raypack serve`.

    A new local cluster (`ray.init()` without an address) turns Ray's token authentication on
    and says so at WARNING (ray/_private/authentication/authentication_token_setup.py); that
    is the safe default and needs nothing from the user (the token is in ~/.ray/auth_token
    for a `ray job submit` to the same machine), so it is not a warning for our commands.
    That logger's ERRORs still show."""
    logging.getLogger(TOKEN_AUTH_LOGGER).setLevel(logging.ERROR)


def quiet_ray_data(options: ConsoleOptions) -> None:
    """Ray Data's progress tables off (on with verbose) and its console at the libraries'
    level; its log file (ray-data.log in the session's logs) keeps everything."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = options.verbose
    ctx.enable_operator_progress_bars = options.verbose
    if not options.verbose:
        # Ray Data's memory detector warns that an operator's workers use more memory than Ray
        # reserved for them: an engine actor holds its model and KV cache (GBs) by design, and
        # Ray reserves memory for it only when asked (--memory-gb-per-actor, the detector's own
        # advice), which a small machine running one job does not need. --verbose shows it.
        detectors = ctx.issue_detectors_config.high_memory_detector_config
        detectors.detection_time_interval_s = -1
    level = logging.INFO if options.verbose else logging.WARNING
    for handler in logging.getLogger("ray.data").handlers:
        if type(handler).__name__ != "SessionFileHandler":  # the console, not the log file
            handler.setLevel(level)


@contextmanager
def filter_stderr(patterns: tuple[re.Pattern[str], ...] = HARMLESS_STDERR) -> Iterator[None]:
    """Drop the lines matching `patterns` from this process's file descriptor 2 (where Ray's
    C++ core worker writes, below Python's logging) while the block runs; every other byte
    passes through unchanged, in order. Written by hand: no library filters a file descriptor.
    Does nothing when stderr has no file descriptor (pytest's capture).

    Enter it after Ray has started its local processes: a process started inside the block
    inherits the pipe as its stderr."""
    try:
        target = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(target)
    read_end, write_end = os.pipe()
    os.dup2(write_end, target)
    os.close(write_end)
    pump = threading.Thread(target=_pump, args=(read_end, saved, patterns), daemon=True)
    pump.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, target)  # closes the pipe's last write end: the pump sees EOF
        pump.join(timeout=5)
        if not pump.is_alive():  # else a process still holds the pipe: the pump forwards on
            os.close(saved)


def filter_forwarded_logs(patterns: tuple[re.Pattern[str], ...] = HARMLESS_STDERR) -> None:
    """Drop the lines matching `patterns` from what Ray prints on the driver for its other
    processes: their log lines (`log_to_driver`) and the errors the raylet pushes to every
    driver (the worker-startup warning among them: Ray prints those on the driver's *stdout*,
    from `listen_error_messages`, which `filter_stderr` does not see). Both go through
    `ray._private.worker.print_to_stdstream`, which is replaced by a filtering one; call this
    before `ray.init` (which binds it into its log printer). For the rest of the process: only
    the command that owns it calls this. Ray has no public hook for either; nothing changes
    when that private function is not there."""
    try:
        from ray._private import worker
    except ImportError:
        return
    printer = getattr(worker, "print_to_stdstream", None)
    if printer is None or getattr(printer, "raypack_filtered", False):
        return
    filtered = _dropping(printer, patterns)
    filtered.raypack_filtered = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = filtered


def _dropping(print_lines: Any, patterns: tuple[re.Pattern[str], ...]) -> Any:
    def kept(data: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        lines = [line for line in data.get("lines", []) if not _matches(line.encode(), patterns)]
        if lines:
            print_lines({**data, "lines": lines}, *args, **kwargs)

    return kept


def _pump(read_end: int, out: int, patterns: tuple[re.Pattern[str], ...]) -> None:
    pending = b""
    with os.fdopen(read_end, "rb", buffering=0) as source:
        while chunk := source.read(65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            kept = [line for line in lines if not _matches(line, patterns)]
            if kept:
                _write(out, b"".join(line + b"\n" for line in kept))
            if pending and not pending.startswith(b"["):  # a bar without newline: now
                _write(out, pending)
                pending = b""
    if pending:
        _write(out, pending)


def _write(fd: int, data: bytes) -> None:
    # Never raises: a pump that stopped reading would block every writer of fd 2 once the
    # pipe is full (the job would hang); output that cannot be written is dropped instead.
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        pass


def _matches(line: bytes, patterns: tuple[re.Pattern[str], ...]) -> bool:
    text = line.decode("utf-8", "replace")
    return any(p.search(text) for p in patterns)


def progress_watch(options: ConsoleOptions, source: Any) -> Any:
    """The `run_job` watch that shows the job's progress (pipeline/job/progress.py), or None with
    --no-progress. `source`: the job's `pipeline.io.read.InputSource` (its rows are the total)."""
    if not options.progress:
        return None
    from pipeline.job import progress

    total = progress.count_input_rows(list(source.paths), source.format)

    def watch(board: Any, done_before: int) -> Any:
        return progress.watch(board, done_before, total, options.progress_interval_s)

    return watch


def summary_text(summary: Any, as_json: bool) -> str:
    """The run's summary as the command prints it once: the line (or the JSON), the job's
    phases (pipeline/job/phases.py), where the output went and where the report is."""
    from dataclasses import asdict

    from pipeline.io import storage
    from pipeline.io.report import REPORT_FILE, SUMMARY_FILE
    from pipeline.job.phases import phases_line

    if as_json:
        return json.dumps(asdict(summary), indent=2)
    report = storage.join(summary.output, REPORT_FILE)
    timing = phases_line(summary.phases_s)
    return (
        f"{summary.log_line()}\n"
        + (f"time: {timing}\n" if timing else "")
        + f"output: {summary.output}\n"
        f"report: {report} (figures in {storage.join(summary.output, SUMMARY_FILE)})"
    )
