"""Hostile input to the offline job (issue 18): bad override values become error rows that
name the column, the field and the value while their shard generates; malformed CSV, JSONL
and Parquet inputs and a bad --output fail before any work (exit 2) naming the file, line or
flag; the output folder is locked to one job and only the job's own files are deleted."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.config import EngineConfig, SamplingParams
from pipeline.config import ComputeConfig, InputConfig, JobConfig, PlanConfig, PromptConfig
from pipeline.io.output import LOCK_FILE, STALE_S, OutputBusyError, OutputFolder, check_output
from pipeline.io.read import check_input, resolve_input
from pipeline.stages.prompts import RowError, merge_sampling, sampling_overrides
from tests.pipeline.refusals import refusals

ROOT = Path(__file__).parents[2]


def _override_error(row: dict, sampling_column: str | None = None) -> str:
    columns = [c for c in row if c != sampling_column]
    with pytest.raises(RowError) as info:
        merge_sampling(SamplingParams(), sampling_overrides(row, columns, sampling_column))
    return str(info.value)


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        (
            {"seed": 2**64},
            r"column 'seed'.*seed must be an integer in \[.*got 18446744073709551616",
        ),
        ({"seed": float(2**64)}, r"column 'seed'.*got 18446744073709551616"),  # JSON/CSV: double
        ({"top_k": 2**63}, r"column 'top_k'.*top_k must be an integer.*got 9223372036854775808"),
        ({"temperature": float("nan")}, r"column 'temperature'.*finite number.*got nan"),
        ({"temperature": float("inf")}, r"column 'temperature'.*got inf"),
        ({"temperature": 1e30}, r"column 'temperature'.*\[0.0, 10000.0\], got 1e\+30"),
        ({"temperature": "hot"}, r"column 'temperature': 'hot' is not a number"),
        ({"max_tokens": "many"}, r"column 'max_tokens': 'many' is not an integer"),
        ({"sp": {"seed": 2**64}}, r"column 'sp' \(field 'seed'\).*got 18446744073709551616"),
    ],
)
def test_bad_override_values_name_column_field_and_value(row, expected):
    import re

    sampling_column = "sp" if "sp" in row else None
    message = _override_error(row, sampling_column)
    assert re.search(expected, message), message


def test_text_override_columns_are_coerced_to_their_declared_types():
    row = {"temperature": "0.7", "top_k": "5", "max_tokens": "8.0", "seed": " 3 ", "top_p": ""}
    found = sampling_overrides(row, list(row), None)
    assert found == {"temperature": 0.7, "top_k": 5, "max_tokens": 8, "seed": 3}
    params = merge_sampling(SamplingParams(), found)
    assert (params.temperature, params.top_k, params.max_tokens, params.seed) == (0.7, 5, 8, 3)
    ignore = sampling_overrides({"ignore_eos": "true", "stop": ["x"]}, ["ignore_eos", "stop"], None)
    assert ignore == {"ignore_eos": True, "stop": ("x",)}


def _check(path: Path) -> None:
    check_input(resolve_input(InputConfig(str(path))))


def test_csv_with_an_unterminated_quote_names_file_and_line(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text('id,prompt\nc1,"good one"\nc2,"unterminated\nc3,good three\nc4,good four\n')
    with pytest.raises(ValueError, match=r"x\.csv: line 3: a quoted value opened there is never"):
        _check(path)
    path.write_text("id,prompt\nc1,one\nc2,two,three\n")
    with pytest.raises(ValueError, match=r"x\.csv: line 3 has 3 values, the header has 2"):
        _check(path)


def test_csv_values_with_newlines_are_read_whole(tmp_path):
    path = tmp_path / "ok.csv"
    path.write_text('id,prompt\nc1,"two\nlines"\nc2,plain\n')
    assert check_input(resolve_input(InputConfig(str(path)))).csv_multiline_values
    path.write_text("id,prompt\nc1,one\n")
    assert not check_input(resolve_input(InputConfig(str(path)))).csv_multiline_values


def test_bad_jsonl_line_and_corrupt_parquet_name_the_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": "a", "p": "x"}\n\n{"id": "b", "p": \n')
    with pytest.raises(ValueError, match=r"rows\.jsonl: line 3 is not JSON"):
        _check(path)
    path.write_text('{"id": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"rows\.jsonl: line 2 is not a JSON object"):
        _check(path)
    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(pa.table({"id": ["a"]}), folder / "a.parquet")
    (folder / "b.parquet").write_bytes((folder / "a.parquet").read_bytes()[:40])
    with pytest.raises(ValueError, match=r"b\.parquet: not a readable Parquet file"):
        _check(folder)


def test_output_that_is_a_file_or_read_only_fails_naming_the_flag(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"--output '.*file' is a file, not a folder"):
        check_output(str(tmp_path / "file"))
    with pytest.raises(ValueError, match=r"--output '.*file/sub' cannot be written"):
        check_output(str(tmp_path / "file" / "sub"))
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        if os.access(locked, os.W_OK):  # root writes anyway: use a folder nobody can write
            locked = Path("/sys/kernel")
            if not locked.is_dir() or _writable(locked):
                pytest.skip("no read-only folder to try as this user")
        with pytest.raises(ValueError, match=r"--output '.*' cannot be written"):
            check_output(str(locked))
    finally:
        (tmp_path / "ro").chmod(0o755)


def _writable(folder: Path) -> bool:
    try:
        (folder / f".probe-{os.getpid()}").write_bytes(b"")
    except OSError:
        return False
    (folder / f".probe-{os.getpid()}").unlink()
    return True


def test_output_folder_lock_refuses_a_second_job_and_takes_over_stale_locks(tmp_path, caplog):
    out = tmp_path / "out"
    first = OutputFolder.claim(str(out))
    with pytest.raises(
        OutputBusyError, match=rf"in use by another job \(host .*, pid {os.getpid()}"
    ):
        OutputFolder.claim(str(out))
    first.release()
    assert not (out / LOCK_FILE).exists()
    with OutputFolder.claim(str(out)) as again:  # the same job token: its files stay its own
        assert again.token == first.token

    # A killed driver on this host: its pid is gone.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_lock(out, socket.gethostname(), dead.pid)
    with caplog.at_level("WARNING"), OutputFolder.claim(str(out)):
        pass
    assert "that process is gone" in caplog.text

    # Another host's lock: fresh, refused; its heartbeat too old, taken over.
    _write_lock(out, "elsewhere", 1)
    with pytest.raises(OutputBusyError, match="host elsewhere, pid 1"):
        OutputFolder.claim(str(out))
    old = time.time() - STALE_S - 5
    os.utime(out / LOCK_FILE, (old, old))
    with OutputFolder.claim(str(out)) as taken:
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
        assert taken.is_ours(f"{taken.filename_prefix()}_abc_000000-0.parquet")
        assert not taken.is_ours("data.parquet")


def _write_lock(out: Path, host: str, pid: int) -> None:
    (out / LOCK_FILE).write_text(json.dumps({"host": host, "pid": pid, "started": time.time()}))


def test_cli_exits_2_before_any_work(tiny_model_dir, tmp_path):
    """Bad CSV, a file as --output, a folder another job holds: exit 2 naming the problem,
    before Ray starts."""
    good = tmp_path / "good.csv"
    good.write_text("id,prompt\nc1,hello\n")
    bad = tmp_path / "x.csv"
    bad.write_text('id,prompt\nc1,"good one"\nc2,"unterminated\nc3,good three\nc4,good four\n')
    (tmp_path / "afile").write_text("")
    model = ["--model", str(tiny_model_dir), "--dtype", "float32", "--prompt-column", "prompt"]
    cases = [
        (["--input", str(bad), "--output", str(tmp_path / "o1")], "x.csv: line 3"),
        (["--input", str(good), "--output", str(tmp_path / "afile")], "--output"),
    ]
    with OutputFolder.claim(str(tmp_path / "held")):
        cases.append(
            (["--input", str(good), "--output", str(tmp_path / "held")], "in use by another job")
        )
        runs, stderr = refusals([[*args, *model] for args, _ in cases])  # one process
    for run, (_, message) in zip(runs, cases, strict=True):
        assert run.returncode == 2, run.stderr[-2000:]
        assert message in run.stderr, run.stderr[-2000:]
        assert not run.ray_started  # refused before Ray
    assert "Started a local Ray" not in stderr


HOSTILE_CSV = """id,prompt,temperature,seed,top_k
ok-1,The first note says the sky is blue. What colour is the sky?,,,
big-seed,The second note is about trains. When do they leave?,0.5,18446744073709551616,
big-top-k,The third note lists fruit: apples and pears. Name one.,0.7,,9223372036854775808
nan-temp,The fourth note: bread needs flour and water. What else?,nan,,
inf-temp,The fifth note: the sea is salty. Why?,inf,,
huge-temp,The sixth note: cats sleep a lot. How much?,1e30,,
text-temp,The seventh note: rain is wet. Is it?,hot,,
ok-2,The eighth note: tea is warm. Why is it warm?,,,
ok-3,The ninth note: snow is cold and white. Why?,0.0,7,
"""

EXPECTED_ERRORS = {
    "big-seed": "column 'seed'",
    "big-top-k": "column 'top_k'",
    "nan-temp": "column 'temperature'",
    "inf-temp": "column 'temperature'",
    "huge-temp": "column 'temperature'",
    "text-temp": "column 'temperature': 'hot' is not a number",
}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hostile_override_rows_are_error_rows_and_their_shard_generates(
    ray_cluster, tiny_model_dir, tmp_path
):
    from actors import LLMEngine
    from pipeline.job.run import run_job

    table = tmp_path / "rows.csv"
    table.write_text(HOSTILE_CSV)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.parquet").write_bytes(b"not parquet, the user's own file")
    config = JobConfig(
        input=InputConfig(str(table)),
        prompt=PromptConfig(
            prompt_column="prompt", override_columns=("temperature", "seed", "top_k")
        ),
        output=str(tmp_path / "out"),
        engine=EngineConfig(dtype="float32", model=str(tiny_model_dir), max_num_seqs=16),
        sampling=SamplingParams(max_tokens=3),
        plan=PlanConfig(num_partitions=1, key_block_size=4),
        compute=ComputeConfig(num_actors=1, num_cpus_per_actor=0.25, resources=(("fake_gpu", 1),)),
    )
    summary = run_job(config)
    rows = {
        r["id"]: r
        for r in pq.read_table(tmp_path / "out", ignore_prefixes=[".", "_", "mine"]).to_pylist()
    }
    assert set(rows) == {"ok-1", "ok-2", "ok-3", *EXPECTED_ERRORS}
    for row_id, message in EXPECTED_ERRORS.items():
        assert message in (rows[row_id]["error"] or ""), (row_id, rows[row_id]["error"])
        assert rows[row_id]["finish_reason"] == "error"
    assert summary.error_rows == len(EXPECTED_ERRORS)
    # The good rows ran, greedy, and match the engine on each prompt alone.
    engine = LLMEngine(EngineConfig(dtype="float32", model=str(tiny_model_dir)))
    prompts = {r.split(",")[0]: r.split(",")[1] for r in HOSTILE_CSV.splitlines()[1:]}
    for row_id in ("ok-1", "ok-2", "ok-3"):
        alone = engine.generate([prompts[row_id]], SamplingParams(max_tokens=3))[0]
        assert rows[row_id]["error"] is None
        assert rows[row_id]["generated_token_ids"] == list(alone.token_ids), row_id
    assert (tmp_path / "out" / "mine.parquet").exists()  # a foreign file is left alone
    assert not (tmp_path / "out" / LOCK_FILE).exists()  # released


def test_dedupe_marks_versions_of_an_id_and_keys_identical_rows_together():
    from pipeline.stages import dedupe, stage

    batch = pa.table(
        {
            stage.ID: ["a", "a", "b", "a"],
            stage.ERROR: [None, None, None, None],
            dedupe.CONTENT: ["h1", "h1", "h3", "h2"],
        },
        schema=pa.schema(
            [(stage.ID, pa.string()), (stage.ERROR, pa.string()), (dedupe.CONTENT, pa.string())]
        ),
    )
    marked, dropped = dedupe.resolve(batch, {}, "error")
    assert dropped == 0
    assert marked.column(dedupe.DEDUPE_KEY).to_pylist() == ["a\0h1", "a\0h1", "b", "a\0h2"]
    errors = marked.column(stage.ERROR).to_pylist()
    assert errors[2] is None and all(
        "2 input rows with different content" in errors[i] for i in (0, 1, 3)
    )
    # The collector knows a version another partition holds, with its preview.
    other = {"b": [("h0", '{"id": "b", "prompt": "the other"}'), ("h3", None)]}
    marked, _ = dedupe.resolve(batch, other, "error")
    assert "the other" in marked.column(stage.ERROR)[2].as_py()
    kept, dropped = dedupe.resolve(batch, other, "first")
    assert kept.column(stage.ID).to_pylist() == ["a", "a"] and dropped == 2


def test_sampling_columns_are_used_only_when_named(tiny_model_dir, tmp_path):
    """A column that happens to be called `temperature` or `max_tokens` changes nothing unless
    --sampling-columns names it; a name that is no sampling field fails before any work."""
    from jobs.generate import build_config, build_parser
    from pipeline.job.run import prepare

    table = tmp_path / "rows.csv"
    table.write_text("id,prompt,temperature,max_tokens\nr1,hello,0.9,2\n")
    base = ["--input", str(table), "--output", str(tmp_path / "out")]
    base += ["--model", str(tiny_model_dir), "--dtype", "float32", "--prompt-column", "prompt"]

    def overrides(*flags: str) -> tuple[str, ...]:
        return prepare(build_config(build_parser().parse_args([*base, *flags]))).override_columns

    assert overrides() == ()
    assert overrides("--sampling-columns", "temperature,max_tokens") == (
        "temperature",
        "max_tokens",
    )
    with pytest.raises(ValueError, match=r"sampling columns \['prompt'\] are not SamplingParams"):
        build_config(build_parser().parse_args([*base, "--sampling-columns", "prompt"]))
    with pytest.raises(ValueError, match="'top_k'.*a sampling override column"):
        overrides("--sampling-columns", "top_k")
