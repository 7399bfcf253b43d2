"""`raypack generate --dry-run` (pipeline/dry_run.py): reads and plans in this process, times
the tiny engine for a moment, prints the plan and an estimate; starts no Ray, writes nothing
to the output folder, and counts the rows a resumed folder already has."""

from __future__ import annotations

import logging
import re
import shutil
import warnings

import pyarrow.parquet as pq
import pytest

from pipeline.commands import generate
from pipeline.console import LOG_LEVEL_ENV, OURS
from pipeline.dry_run import Calibration, DryRun
from tests.pipeline.data import MALFORMED, TEMPLATE, rows


@pytest.fixture(autouse=True)
def process_state(monkeypatch):
    """The command sets up the process's logging, warnings and environment (it owns its
    process); put them back for the tests that run after it in this one."""
    for name in (LOG_LEVEL_ENV, "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    names = (*OURS, "ray")
    levels = {n: logging.getLogger(n).level for n in names}
    with warnings.catch_warnings():
        yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for n, lvl in levels.items():
        logging.getLogger(n).setLevel(lvl)


def run_dry(capsys, table, model, output, *extra: str) -> str:
    code = generate.main(
        [
            "--input",
            str(table),
            "--output",
            str(output),
            "--template",
            TEMPLATE,
            "--model",
            str(model),
            "--max-tokens",
            "8",
            "--dry-run",
            *extra,
        ]  # fmt: skip
    )
    out = capsys.readouterr().out
    assert code == 0, out
    return out


def test_dry_run_prints_the_plan_without_ray(capsys, prompt_table, tiny_model_dir, tmp_path):
    import ray

    def tripwire(*args, **kwargs):
        raise AssertionError("the dry run started Ray or a Ray actor/task")

    # Ray may be up in this process (other tests' cluster): then any actor or task the dry
    # run made would go through ray.remote (Ray Data's too), and a new Ray through ray.init.
    initialized = ray.is_initialized()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ray, "init", tripwire)
        patch.setattr(ray, "remote", tripwire)
        output = tmp_path / "out"
        out = run_dry(capsys, prompt_table, tiny_model_dir, output)
    assert ray.is_initialized() == initialized
    assert "no engine actor started" in out
    n, errors = len(rows()), len(MALFORMED - {"unknown-override", "bad-override"})
    assert f"rows: {n} in the input, 0 already done" in out
    assert f"({errors} with an error before the engine)" in out
    saving = re.search(r"prefix saving: ([\d.]+)% of the prompt tokens \(optimum ([\d.]+)%", out)
    assert saving and 0 < float(saving.group(1)) <= float(saving.group(2))
    prompt, compute = map(
        int, re.search(r"prompt tokens: (\d+) in all, (\d+) to compute", out).groups()
    )
    assert 0 < compute < prompt
    assert re.search(r"shards: [1-9]", out)
    assert re.search(r"engine time: about \d+ s on 1 engine actor", out)
    picture = re.search(r"the plan's picture: (\S+\.png)", out).group(1)
    assert open(picture, "rb").read(4) == b"\x89PNG"
    # Nothing written: not even the output folder.
    assert not output.exists()


def test_dry_run_counts_rows_already_done(capsys, prompt_table, tiny_model_dir, tmp_path):
    """A folder a run left: its ids are done, the rest is planned; the folder is untouched."""
    output = tmp_path / "out"
    output.mkdir()
    (output / "_raypack_job.json").write_text('{"job": "abc123", "created": 0}\n')
    done = pq.read_table(prompt_table).slice(0, 5).select(["id"])
    pq.write_table(done, output / "raypack-abc123_run-0-00001.parquet")
    before = sorted(p.name for p in output.iterdir())
    out = run_dry(capsys, prompt_table, tiny_model_dir, output)
    n = len(rows())
    assert f"rows: {n} in the input, 5 already done in {output}, {n - 5} to run" in out
    assert sorted(p.name for p in output.iterdir()) == before
    shutil.rmtree(output)


def test_the_estimate_is_prefill_plus_decode_waves() -> None:
    plan = DryRun(
        input_rows=100, done_rows=0, rows=100, error_rows=4, prompt_tokens=10_000,
        saved_tokens=6_000, optimal_saved_tokens=7_000, shards=2, shared_groups=10,
        max_share_degree=5, max_tokens=20, num_actors=2, picture=None,
        calibration=Calibration(prefill_tokens_per_s=1000, decode_step_s=0.1, batch=32, seconds=3),
    )  # fmt: skip
    # 4,000 tokens to compute over 2 actors at 1,000/s; 96 rows -> 48 per actor -> 2 waves of 32.
    assert plan.engine_seconds() == pytest.approx(2.0 + 2 * 20 * 0.1)
    assert "engine time: about 6 s on 2 engine actor(s)" in plan.text("o")
