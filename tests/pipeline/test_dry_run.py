"""`raypack generate --dry-run` (pipeline/job/dry_run.py): reads and plans in this process, times
the tiny engine for a moment, prints the plan and an estimate; starts no Ray, writes nothing
to the output folder, and counts the rows a resumed folder already has."""

from __future__ import annotations

import logging
import math
import re
import shutil
import warnings

import pyarrow.parquet as pq
import pytest

from pipeline.commands import generate
from pipeline.commands.console import LOG_LEVEL_ENV, OURS
from pipeline.job.dry_run import DryRun
from pipeline.job.estimate import (
    JOB_START_S,
    Calibration,
    estimate,
    fit_step_cost,
    prefill_rate,
    sample_rows,
)
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
    assert re.search(r"engine time: about \d+ s on 1 engine\b", out)
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


def calibration(**changes) -> Calibration:
    figures = dict(
        prefill_tokens_per_s=1000.0, step_overhead_s=0.02, step_per_sequence_s=0.001,
        sampled_rows=8, mean_output_tokens=11.0, max_output_tokens=31, seconds=3.0, load_s=0.8,
    )  # fmt: skip
    return Calibration(**{**figures, **changes})


def plan(**changes) -> DryRun:
    figures = dict(
        input_rows=100, done_rows=0, rows=100, error_rows=4, prompt_tokens=10_000,
        saved_tokens=6_000, optimal_saved_tokens=7_000, shards=2, shared_groups=10,
        max_share_degree=5, max_tokens=48, samples_per_row=1, num_engines=2, max_num_seqs=256,
        max_num_batched_tokens=512, picture=None, calibration=calibration(),
    )  # fmt: skip
    return DryRun(**{**figures, **changes})


def test_few_rows_decode_as_one_batch_until_the_longest_ends() -> None:
    # 96 rows over 2 actors: 48 each, all in one batch (cap 256), so the decode takes the
    # longest row's steps (30 after its prefill) and 48 x 10 decode tokens.
    dry = plan()
    prefill = 4_000 / 2 / 1000
    decode = 30 * 0.02 + 48 * 10 * 0.001
    assert dry.engine_seconds() == pytest.approx(prefill + decode)
    parts = estimate(dry.workload(), dry.calibration)
    assert (parts.decode_steps, parts.decode_tokens) == (30, 480)
    out = dry.text("o")
    assert "engine time: about 3 s on 2 engine(s)" in out
    assert "from 3 s of calibration here on 8 sampled rows" in out
    assert "they generated 11.0 tokens on average (at most 31, --max-tokens 48)" in out
    assert "a decode step 20 ms + 1.0 ms per sequence (68 ms at 48)" in out
    # The job's summary counts its start too: JOB_START_S and the model load measured here.
    assert dry.calibration.job_start_s() == pytest.approx(JOB_START_S + 0.8)
    assert f"the job: about 10 s with its start (about {JOB_START_S + 0.8:.0f} s" in out


def test_many_rows_fill_the_batch_cap_then_drain() -> None:
    # 1,000 rows on 1 actor, n=2: 2,000 sequences, 20,000 decode tokens; the budget (128
    # tokens a step) caps the batch below max_num_seqs: 157 full steps + the drain (31 - 11).
    dry = plan(
        rows=1000, error_rows=0, num_engines=1, samples_per_row=2, max_num_batched_tokens=128
    )
    work = dry.workload()
    assert (work.sequences, work.batch_cap, work.batch()) == (2000, 128, 128)
    parts = estimate(work, dry.calibration)
    assert parts.decode_steps == math.ceil(20_000 / 128 + 20) == 177
    assert parts.decode_s == pytest.approx(177 * 0.02 + 20_000 * 0.001)
    assert parts.prefill_s == pytest.approx(4.0)
    # max_num_seqs caps it when it is the smaller: 2,000 / 64 steps instead.
    steps = estimate(plan(**{**dry.__dict__, "max_num_seqs": 64}).workload(), dry.calibration)
    assert steps.decode_steps == math.ceil(20_000 / 64 + 20)


def test_rows_that_stop_at_once_cost_only_their_prefill() -> None:
    dry = plan(calibration=calibration(mean_output_tokens=1.0, max_output_tokens=1))
    assert dry.engine_seconds() == pytest.approx(2.0)
    assert plan(error_rows=100).engine_seconds() is None
    assert plan(calibration=None).engine_seconds() is None


def test_the_step_cost_is_a_line_through_each_batch_size_median() -> None:
    # 1..8 sequences from the sampled rows (noisy repeats at 8), 97 at the job's batch.
    steps = [(8, 0.030), (8, 0.029), (8, 0.500), *((b, 0.022 + 0.001 * b) for b in range(1, 8))]
    steps += [(97, 0.119), (97, 0.119), (97, 0.118)]
    overhead, per_sequence = fit_step_cost(steps)
    assert overhead == pytest.approx(0.022, abs=5e-4)
    assert per_sequence == pytest.approx(0.001, abs=2e-5)
    # One batch size: all of it per sequence; a falling line: flat.
    assert fit_step_cost([(4, 0.04), (4, 0.06)]) == pytest.approx((0.0, 0.0125))
    assert fit_step_cost([(1, 0.05), (9, 0.03)]) == pytest.approx((0.04, 0.0))
    assert fit_step_cost([]) == (0.0, 0.0)


def test_the_sample_spreads_over_the_rows_within_its_token_cap() -> None:
    assert sample_rows(100, [10] * 100) == [0, 12, 25, 37, 50, 62, 75, 87]
    assert sample_rows(3, [10] * 3) == [0, 1, 2]
    # Long prompts: as many as fit (the first always).
    assert sample_rows(100, [1500] * 100) == [0, 12]
    assert sample_rows(100, [9000] * 100) == [0]


def test_the_prefill_rate_is_the_median_of_full_steps() -> None:
    # 512-token steps at ~1,700 tokens/s, one slowed 4x; the last short step left out.
    steps = [(512, 0.30), (512, 1.20), (512, 0.31), (512, 0.29), (512, 0.30), (100, 0.2)]
    assert prefill_rate(steps, 512) == pytest.approx(512 / 0.30)
    # No step near the budget (a short sample): all of them.
    assert prefill_rate([(100, 0.1), (60, 0.1)], 512) == pytest.approx(800)
