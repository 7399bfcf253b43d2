"""What a job command prints: the progress line (pipeline/job/progress.py), a quiet console
(pipeline/commands/console.py), `--help` that starts with the common flags (pipeline/commands/help_groups.py),
`raypack --version`; and one tiny job through the CLI that shows them all."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pytest

from pipeline.commands import generate, snippets
from pipeline.commands.console import HARMLESS_STDERR
from pipeline.commands.help_groups import COMMON_TITLE
from pipeline.job.progress import Counts, Progress, ProgressBoard, ProgressDisplay, ProgressReporter
from tests.fresh_python import run_python
from tests.pipeline.data import MALFORMED, TEMPLATE, rows
from tests.pipeline.test_commands import raypack
from tests.pipeline.test_job import read_output

# A line a clean run must not print: a log record at WARNING or above, a Python warning, a
# C++ error line of Ray's (`[time E pid tid] file.cc:line: ...`).
NOT_CLEAN = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Warning:|^\S*\[[^\]]* [EF] \d+ \d+\]")


def test_progress_figures() -> None:
    counts = Counts(
        rows=30, errors=2, prompt_tokens=1000, cached_tokens=700, generated_tokens=600, started=100
    )
    p = Progress.of(counts, total=100, done_before=10, now=130)
    assert p.done == 40 and p.errors == 2
    assert p.generated_tokens_per_s == pytest.approx(20.0)
    assert p.cache_saving == pytest.approx(0.7)
    assert p.eta_s == pytest.approx(60 / 1.0)  # 60 rows left at 30 rows / 30 s
    # The recent rate, when given: 20 rows in the last 5 s.
    recent = Progress.of(counts, total=100, done_before=10, now=130, earlier=(125, 10))
    assert recent.eta_s == pytest.approx(60 / 4.0)
    assert p.line().startswith("progress: 40/100 rows (40%), 20.0 generated tok/s")
    assert "prefix cache saved 70%" in p.line() and "2 errors" in p.line()
    assert "ETA 1:00" in p.line()
    # No engine ready yet, no total known: no rate, no time left, no percentage.
    idle = Progress.of(Counts(), total=None, done_before=0, now=5)
    assert idle.eta_s is None and idle.line().startswith("progress: 0 rows, 0.0 generated")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_live_bar_and_a_pipe_gets_lines() -> None:
    counts = Counts(rows=3, prompt_tokens=100, cached_tokens=50, generated_tokens=30, started=0)
    tty = Terminal()
    bar = ProgressDisplay(board=None, total=10, done_before=2, stream=tty)
    assert bar.live and bar.interval_s == 1.0
    bar.open()
    bar.render(counts, now=10.0)
    bar.close()
    drawn = tty.getvalue()
    assert "\r" in drawn and "5/10 rows" in drawn and "3.0 generated tok/s" in drawn
    assert "prefix cache saved 50%" in drawn and "ETA 0:17" in drawn  # 5 left at 0.3 rows/s
    pipe = io.StringIO()
    lines = ProgressDisplay(board=None, total=10, done_before=2, stream=pipe)
    assert not lines.live and lines.interval_s == 10.0
    lines.open()  # nothing on a pipe
    lines.render(counts, now=10.0)
    lines.render(Counts(rows=8, started=0), now=20.0)
    assert pipe.getvalue().splitlines() == [
        "progress: 5/10 rows (50%), 3.0 generated tok/s, prefix cache saved 50% of prompt "
        "tokens, 0 errors, ETA 0:17",
        # The recent rate: 5 rows in the last 10 s.
        "progress: 10/10 rows (100%), 0.0 generated tok/s, prefix cache saved 0% of prompt "
        "tokens, 0 errors, ETA 0:00",
    ]


def test_counts_add_up_with_the_earliest_start() -> None:
    total = Counts()
    total.add(Counts(rows=2, generated_tokens=5, started=20.0))
    total.add(Counts(rows=3, errors=1, started=10.0))
    total.add(Counts(rows=1))  # a reporter that sent before its start (never: still summed)
    assert (total.rows, total.errors, total.generated_tokens, total.started) == (6, 1, 5, 10.0)


class LocalBoard:
    """The board's actor handle in this process: `report.remote(...)` calls the board."""

    def __init__(self) -> None:
        self.board = ProgressBoard()
        self.report = self

    def remote(self, reporter: str, counts: Counts) -> None:
        self.board.report(reporter, counts)


def test_a_row_with_several_samples_counts_once(tiny_model_dir: Path) -> None:
    """The engine feed's finished rows reach the reporter as rows: n=3 samples are one row
    (and their tokens all count)."""
    from actors import LLMEngine
    from actors.config import EngineConfig, SamplingParams
    from pipeline.stages.feed import EngineFeed

    config = EngineConfig(dtype="float32", model=str(tiny_model_dir), max_num_seqs=16)
    engine = LLMEngine(config)
    board = LocalBoard()
    reporter = ProgressReporter(board, every_s=0.0)
    feed = EngineFeed(
        engine, lambda: LLMEngine(config), lambda e: None, on_finished=reporter.finished
    )
    prompts = [engine.tokenizer.encode(t) for t in ("Tea grows", "Coffee is", "Rain falls")]
    params = [
        SamplingParams(max_tokens=4, ignore_eos=True, n=3),
        SamplingParams(max_tokens=4, ignore_eos=True),
        SamplingParams(max_tokens=4, ignore_eos=True, n=2),
    ]
    outputs = feed.generate("s", prompts, params, [])
    reporter.flush()
    total = board.board.total()
    assert len(outputs) == 6
    assert (total.rows, total.errors) == (3, 0)
    assert total.generated_tokens == sum(len(o.token_ids) for o in outputs) == 24


@pytest.mark.parametrize(
    "command, first",
    [
        (generate, ["--input", "--output", "--prompt-column", "--template", "--messages-column"]),
        (snippets, ["--input", "--output", "--document-column", "--query-column"]),
    ],
)
def test_help_starts_with_the_common_flags(command, first) -> None:
    text = command.build_parser("raypack x").format_help()
    usage, _, rest = text.partition("\n\n")
    assert "[options]" in usage and "--num-actors" not in usage
    groups = re.findall(r"^(\S[^\n]*):$", rest.split("\n\n", 1)[1], flags=re.M)
    assert groups[0] == COMMON_TITLE, groups
    common = rest.split(COMMON_TITLE, 1)[1].split("\n\n", 1)[0]
    flags = re.findall(r"^  (--[a-z-]+)", common, flags=re.M)
    assert flags == [*first, "--model", "--max-tokens"]
    # The rest are below, in their groups; parsing is unchanged.
    for group in ("compute", "console", "plan"):
        assert f"\n{group}:" in text
    args = command.build_parser().parse_args(
        ["--input", "i", "--output", "o", "--max-tokens", "3"]
        + (["--prompt-column", "p"] if command is generate else [])
    )
    assert (args.input, args.output, args.max_tokens, args.log_level) == ("i", "o", 3, "INFO")


def test_version() -> None:
    done = raypack("--version")
    assert done.returncode == 0 and re.fullmatch(r"raypack \S+\n", done.stdout), done.stdout


@pytest.mark.parametrize(
    ("line", "other"),
    [
        (  # Ray Data's actor pools restart actors whose arguments are ObjectRefs
            "[2026-11-26 09:25:58,997 E 6468 6468] core_worker.cc:2465: Actor with class name: "
            "'MapWorker(MapBatches(RowIdStage)->MapBatches(TokenizeStage))' and ID: 'f769' has "
            "constructor arguments in the object store and max_restarts > 0.",
            "[2026-11-26 09:25:58,997 E 6468 6468] core_worker.cc:99: Failed to connect",
        ),
        (  # the raylet under load, as the suite's job printed it (fractional-CPU actors)
            "\x1b[33m(raylet)\x1b[0m WARNING: 8 PYTHON worker processes have been started on "
            "node: 5b92909ac575 with address: 192.0.2.2, which is 4x the maximum expected "
            "startup concurrency (2). This could be a result of using a large number of actors",
            "\x1b[33m(raylet)\x1b[0m WARNING: the node is out of memory",
        ),
    ],
)
def test_only_the_harmless_lines_are_dropped(line: str, other: str) -> None:
    assert any(p.search(line) for p in HARMLESS_STDERR) and NOT_CLEAN.search(line)
    assert not any(p.search(other) for p in HARMLESS_STDERR)


def test_filter_stderr_drops_only_the_harmless_lines() -> None:
    """On a real fd 2 (a subprocess: pytest captures this one's): C-level writes and Python's
    pass through in order, a bar without newline at once, the core worker's line not at all."""
    script = (
        "import os, sys\n"
        "from pipeline.commands.console import filter_stderr\n"
        "with filter_stderr():\n"
        "    os.write(2, b'one\\n[2026-11-26 09:25:58,997 E 6468 6468] core_worker.cc:2465: '\n"
        "             b'Actor with class name: \\'X\\' and ID: \\'y\\' has constructor arguments '\n"
        "             b'in the object store and max_restarts > 0.\\nbar\\r')\n"
        "    print('two', file=sys.stderr)\n"
        "    os.write(2, b'[2026 E 1 1] core_worker.cc:9: something else\\n')\n"
        "print('after', file=sys.stderr)\n"
    )
    done = run_python(script, timeout=60, text=False)
    assert done.stderr == b"one\nbar\rtwo\n[2026 E 1 1] core_worker.cc:9: something else\nafter\n"


@pytest.mark.slow
def test_a_job_shows_moving_progress_and_prints_nothing_alarming(
    prompt_table, tiny_model_dir, tmp_path
) -> None:
    """One `raypack generate` run checks the command end to end: the synthetic table (every
    row once, the malformed ones error rows, the summary's counts), `--model org/name` with
    the model in the HF cache and HF_HUB_OFFLINE=1 running as the folder would
    (tests/actors/test_hub_models.py checks the resolution itself), the progress lines and a
    quiet console. The command starts its own Ray (joining one at RAY_ADDRESS: test_s3.py's
    drivers) and shuts it down beside the report; its workers inherit its HF_HUB_CACHE (on a
    cluster each node reads its own environment's cache). One run for all (2026-11-26: the
    hub-id run of test_commands.py and this one cost 32 s + 25 s in the suite)."""
    from actors.loader import HUB_FILES
    from tests.hub_cache import cache_repo

    cache_repo(tmp_path / "hub", "org/tiny", tiny_model_dir, "a" * 40, list(HUB_FILES))
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "RAY_ADDRESS")}
    env.update(HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    output = tmp_path / "out"
    done = raypack(
        "generate", "--input", str(prompt_table), "--output", str(output),
        "--template", TEMPLATE, "--sampling-column", "sampling", "--keep-columns", "doc_id",
        "--sampling-columns", "max_tokens", "--model", "org/tiny", "--dtype", "float32",
        # Long enough to be watched: 100 tokens for the rows without their own max_tokens
        # (3-6 for the documents' rows), 4 sequences at a time, small shards, a line every
        # 0.25 s (300 tokens at 0.5 s was 45-88 s of the suite).
        "--max-tokens", "100", "--ignore-eos", "--max-num-seqs", "4",
        "--max-rows-per-shard", "8", "--num-partitions", "1",
        "--num-cpus-per-actor", "0.25", "--num-cpus", "2", "--progress-interval", "0.25",
        env=env, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    out = read_output(output)
    assert set(out) == {r["id"] for r in rows()}  # every row, each once
    assert {i for i, r in out.items() if r["error"]} == MALFORMED
    assert all(out[r["id"]]["doc_id"] == r["doc_id"] for r in rows())  # --keep-columns
    lines = (done.stdout + done.stderr).splitlines()
    alarming = [line for line in lines if NOT_CLEAN.search(line)]
    assert not alarming, alarming
    progress = [line for line in lines if line.startswith("progress: ")]
    counts = [int(re.match(r"progress: (\d+)/", line).group(1)) for line in progress]
    total = len(rows())
    assert all(f"/{total} rows" in line for line in progress), progress
    assert counts == sorted(counts) and len(set(counts)) >= 2, progress  # it moves
    # With --sampling-column(s) the two bad overrides are error rows too.
    assert counts[-1] == total and f"{len(MALFORMED)} errors" in progress[-1], progress
    summaries = [line for line in done.stdout.splitlines() if "prefix saving" in line]
    assert len(summaries) == 1, done.stdout
    assert summaries[0].startswith(f"{total} rows ({len(MALFORMED)} errors, 0 already done)")
    assert f"output: {output}" in done.stdout
    # The job's phases, once, the command's Ray shutdown among them (pipeline/job/phases.py).
    timing = [line for line in done.stdout.splitlines() if line.startswith("time: ")]
    assert len(timing) == 1 and "first step at" in timing[0], done.stdout
    assert "imports" in timing[0] and "shutdown" in timing[0], timing
    # The command's Ray went down after the summary and report (pipeline/commands/shutdown.py).
    assert re.search(r"report [0-9.]+, shutdown [0-9.]+$", timing[0]), timing
    assert f"report: {output}/_report.png" in done.stdout
    assert (output / "_report.png").exists()


def test_forwarded_log_lines_lose_only_the_harmless_ones() -> None:
    """Ray's own printer of what its other processes say (no Ray started), in a fresh process
    (the filter holds for the rest of it): the raylet's startup warning is dropped from a
    batch, the batch's other lines are printed as Ray prints them, a batch left empty prints
    nothing."""
    script = """
from ray._private import worker
from pipeline.commands.console import filter_forwarded_logs
filter_forwarded_logs()
filter_forwarded_logs()  # twice: still one filter
warning = ("WARNING: 8 PYTHON worker processes have been started on node: 5b92 with address: "
           "192.0.2.2, which is 4x the maximum expected startup concurrency (2). This could")
worker.print_to_stdstream({"pid": "raylet", "is_err": False, "lines": [warning, "kept"],
                           "ip": "192.0.2.2", "localhost": "192.0.2.2"}, ignore_prefix=True)
worker.print_to_stdstream({"pid": "raylet", "is_err": False, "lines": [warning],
                           "ip": "192.0.2.2", "localhost": "192.0.2.2"}, ignore_prefix=True)
"""
    done = run_python(script)
    assert done.stdout == "kept\n"
