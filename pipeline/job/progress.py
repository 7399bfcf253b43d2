"""The job's progress, live: rows done of the total, generated tokens/s, the prefix cache's
saving so far, errors, and the time left.

    engine actors (ProgressReporter, in the feed thread: a row's request finished)
        -> ProgressBoard (a small Ray actor; each reporter's running totals, every second
           at most, fire and forget)
        -> the driver (ProgressDisplay: a live tqdm bar on a terminal, else one plain line
           every 10 s)

Why not the counts the writers stream back (pipeline/io/writer.py): they arrive when a shard is
written, and a shard is up to `max_rows_per_shard` rows (the 97-row sample is one shard): the
count would sit at 0 for the whole generation and jump to the end. Ray Data's own progress
counts blocks, so it is frozen the same way. A request's end is the finest event a row has.

The line is a live estimate: a shard redone after a worker or an actor died counts its rows
again. The summary at the end is read from the files written and is exact.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, TextIO

REPORT_EVERY_S = 1.0  # a reporter sends its totals at most this often
LINE_EVERY_S = 10.0  # a plain line this often when stderr is not a terminal
BAR_EVERY_S = 1.0  # the bar's refresh on a terminal
RATE_WINDOW_S = 60.0  # the time left is at the rows' rate over about this long


@dataclass
class Counts:
    """Running totals of finished rows (one engine actor's, or all of them summed)."""

    rows: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache had: not computed
    generated_tokens: int = 0
    started: float | None = None  # wall clock (time.time) when the first engine was ready

    def add(self, other: Counts) -> None:
        """Add `other`'s totals; the earlier start."""
        for f in fields(self):
            if f.name != "started":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        if other.started is not None:
            self.started = min(self.started or other.started, other.started)


class ProgressBoard:
    """A Ray actor (`ray.remote(num_cpus=0)(ProgressBoard)`): the latest totals of each
    reporter, summed on request. Totals, not increments, so a lost or late call is harmless."""

    def __init__(self) -> None:
        self._by_reporter: dict[str, Counts] = {}

    def report(self, reporter: str, counts: Counts) -> None:
        """Store `reporter`'s running totals."""
        self._by_reporter[reporter] = counts

    def total(self) -> Counts:
        """Every reporter's totals added up."""
        total = Counts()
        for counts in self._by_reporter.values():
            total.add(counts)
        return total


class ProgressReporter:
    """An engine actor's side: counts finished rows (any thread) and sends its totals to the
    board at most every `every_s` seconds (and on `flush`)."""

    def __init__(self, board: Any, every_s: float = REPORT_EVERY_S) -> None:
        self.board = board
        self.every_s = every_s
        self.key = uuid.uuid4().hex
        self.counts = Counts(started=time.time())
        self._lock = threading.Lock()
        self._sent = 0.0
        self.flush()  # the engine is ready: the time left is measured from here

    def finished(self, outputs: Sequence[Any]) -> None:
        """A row's request finished: its outputs (`actors.outputs.RequestOutput`), one per
        sample (`n`). One row, an error when a sample has one; every sample's tokens."""
        self.add(
            rows=1,
            errors=int(any(out.error is not None for out in outputs)),
            prompt_tokens=sum(out.num_prompt_tokens for out in outputs),
            cached_tokens=sum(out.num_cached_tokens for out in outputs),
            generated_tokens=sum(len(out.token_ids) for out in outputs),
        )

    def add(self, **counts: int) -> None:
        """Add to the totals; send them if the last send is `every_s` old."""
        with self._lock:
            for name, value in counts.items():
                setattr(self.counts, name, getattr(self.counts, name) + value)
            due = time.monotonic() - self._sent >= self.every_s
        if due:
            self.flush()

    def flush(self) -> None:
        """Send the totals now."""
        with self._lock:
            snapshot = Counts(**{f.name: getattr(self.counts, f.name) for f in fields(Counts)})
            self._sent = time.monotonic()
        self.board.report.remote(self.key, snapshot)


@dataclass(frozen=True)
class Progress:
    """What the display shows at one moment."""

    done: int  # rows done, including those done before this run
    total: int | None
    errors: int
    generated_tokens_per_s: float
    cache_saving: float  # cached / prompt tokens of the rows finished so far
    eta_s: float | None

    @classmethod
    def of(
        cls,
        counts: Counts,
        total: int | None,
        done_before: int,
        now: float,
        earlier: tuple[float, int] | None = None,
    ) -> Progress:
        """The figures of the board's totals at wall-clock time `now`. The time left is at
        the rows' rate since `earlier` (time, rows then) when given, else since the first
        engine was ready: rows finish late in a batch (all prompts are prefilled before the
        first ends), so the recent rate says more than the rate since the start."""
        elapsed = now - counts.started if counts.started is not None else 0.0
        rate = counts.rows / elapsed if elapsed > 0 else 0.0
        if earlier is not None and now > earlier[0] and counts.rows > earlier[1]:
            rate = (counts.rows - earlier[1]) / (now - earlier[0])
        done = done_before + counts.rows
        eta = None
        if total is not None and rate > 0:
            eta = max(0, total - done) / rate
        return cls(
            done=done,
            total=total,
            errors=counts.errors,
            generated_tokens_per_s=counts.generated_tokens / elapsed if elapsed > 0 else 0.0,
            cache_saving=counts.cached_tokens / counts.prompt_tokens if counts.prompt_tokens else 0,
            eta_s=eta,
        )

    def details(self) -> str:
        """Everything but the row count, for the bar's postfix and the line."""
        eta = _clock(self.eta_s) if self.eta_s is not None else "?"
        return (
            f"{self.generated_tokens_per_s:.1f} generated tok/s, prefix cache saved "
            f"{self.cache_saving:.0%} of prompt tokens, {self.errors} errors, ETA {eta}"
        )

    def line(self) -> str:
        """The plain line."""
        if self.total:
            rows = f"{self.done}/{self.total} rows ({self.done / self.total:.0%})"
        else:
            rows = f"{self.done} rows"
        return f"progress: {rows}, {self.details()}"


class ProgressDisplay:
    """The driver's side: a thread reads the board's totals and shows them, as a tqdm bar
    when `stream` is a terminal, else as a plain line every `interval_s` seconds."""

    def __init__(
        self,
        board: Any,
        total: int | None,
        done_before: int = 0,
        interval_s: float | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.board = board
        self.total = total
        self.done_before = done_before
        self.stream = stream or sys.stderr
        self.live = _is_terminal(self.stream)
        self.interval_s = interval_s or (BAR_EVERY_S if self.live else LINE_EVERY_S)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._bar: Any = None
        self._seen: deque[tuple[float, int]] = deque()  # (time, rows) of the last RATE_WINDOW_S
        self.last: Progress | None = None

    def start(self) -> None:
        """Show the progress until `stop`."""
        self.open()
        self._thread.start()

    def open(self) -> None:
        """Draw the empty bar (on a terminal; nothing otherwise)."""
        if self.live and self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total,
                initial=self.done_before,
                unit="rows",
                file=self.stream,
                dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} rows [{elapsed}] {postfix}",
            )

    def stop(self) -> None:
        """Show the last figures and end the display."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.show()
        self.close()

    def close(self) -> None:
        """Close the bar (its last state stays on the terminal)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.show()

    def show(self) -> None:
        """Read the board and show one update."""
        import ray

        try:
            counts = ray.get(self.board.total.remote(), timeout=10)
        except Exception:  # noqa: BLE001 (the board is gone: the job is ending)
            return
        self.render(counts, time.time())

    def render(self, counts: Counts, now: float) -> None:
        """Show the board's totals `counts` read at wall-clock time `now`."""
        self._seen.append((now, counts.rows))
        while len(self._seen) > 2 and now - self._seen[1][0] >= RATE_WINDOW_S:
            self._seen.popleft()
        progress = Progress.of(counts, self.total, self.done_before, now, self._seen[0])
        self.last = progress
        if self._bar is not None:
            self._bar.n = progress.done
            self._bar.set_postfix_str(progress.details(), refresh=True)
        else:
            print(progress.line(), file=self.stream, flush=True)


@contextmanager
def watch(
    board: Any,
    done_before: int,
    total: int | None,
    interval_s: float | None = None,
    stream: TextIO | None = None,
) -> Iterator[ProgressDisplay]:
    """Show the progress of the board's reporters while the block runs (a `run_job` watch:
    pipeline/job/run.py). `total`: the input's rows, including those done before this run."""
    display = ProgressDisplay(board, total, done_before, interval_s, stream)
    display.start()
    try:
        yield display
    finally:
        display.stop()


def count_input_rows(paths: list[str], fmt: str) -> int | None:
    """The rows of the input files (Parquet: their footers; JSONL: non-blank lines; CSV:
    records, quoted newlines included), or None for a saved HF dataset. A pass over a text
    input at the speed of reading it, on the driver, before Ray starts."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from pipeline.io import storage

    rows = 0
    for path in paths:
        with storage.open_input(path) as handle:
            if fmt == "parquet":
                rows += pq.ParquetFile(handle).metadata.num_rows
            elif fmt == "jsonl":
                rows += sum(1 for line in handle if line.strip())
            elif fmt == "csv":
                options = pacsv.ParseOptions(newlines_in_values=True)
                reader = pacsv.open_csv(handle, parse_options=options)
                rows += sum(batch.num_rows for batch in reader)
            else:
                return None
    return rows


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"
