"""The `raypack` console command: its entry point, `--help` with every default, bad commands
exiting 2. The one `raypack generate` run on the tiny model (its own Ray, a hub id offline,
the progress lines) is test_progress.py's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.config import EngineConfig, SamplingParams
from pipeline.commands import generate, serve, snippets
from pipeline.config import PlanConfig

ROOT = Path(__file__).parents[2]
COMMANDS = {"generate": generate, "snippets": snippets, "serve": serve}


def raypack(*argv: str, env: dict[str, str] | None = None, timeout: float = 120):
    """`raypack ARGV` from this checkout (`python -m pipeline.commands`, the code the console
    script calls; an installed `raypack` may belong to another checkout)."""
    return subprocess.run(
        [sys.executable, "-m", "pipeline.commands", *argv],
        cwd=ROOT,
        env={**(env or os.environ), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_console_script_is_this_main() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"raypack": "pipeline.commands.main:main"}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_exits_0_and_shows_every_default(name) -> None:
    done = raypack(name, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: raypack {name}")
    text = " ".join(done.stdout.split())  # argparse wraps lines
    parser = COMMANDS[name].build_parser(f"raypack {name}")
    for action in parser._actions:
        if action.option_strings and action.nargs != 0 and not action.required:
            assert "default" in (parser.formatter_class("x")._get_help_string(action) or ""), (
                action.option_strings
            )
    # A few defaults a user meets everywhere, from the one place each is defined.
    assert (
        f"--max-num-seqs MAX_NUM_SEQS running requests at most (default: {EngineConfig.max_num_seqs})"
        in text
    )
    assert f"(default: {EngineConfig.kv_cache_memory_gb})" in text
    if name == "generate":
        assert f"tokens to generate (default: {SamplingParams.max_tokens})" in text
        assert f"(default: {PlanConfig.max_rows_per_shard})" in text
    if name == "snippets":
        assert "tokens to generate (default: 48)" in text  # the task's own, shown as such


def test_no_or_unknown_command_exits_2() -> None:
    assert raypack().returncode == 2
    unknown = raypack("train")
    assert unknown.returncode == 2 and "unknown command 'train'" in unknown.stderr
    top = raypack("--help")
    assert top.returncode == 0 and "generate" in top.stdout and "serve" in top.stdout


def test_bad_flag_value_exits_2_naming_it(tiny_model_dir, tmp_path) -> None:
    done = raypack(
        "generate", "--input", str(tmp_path / "none.parquet"), "--output", str(tmp_path / "o"),
        "--prompt-column", "p", "--max-num-seqs", "0",
    )  # fmt: skip
    assert done.returncode == 2 and "max_num_seqs" in done.stderr
