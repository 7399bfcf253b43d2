"""The job's own column names against every flag that names a column (issue 31 items 1 and
6): a clash is exit 2 naming the flag and the column, before any work. Without the check,
`--text-column id` overwrote the ids (rows doubled or lost on a rerun), `--keep-columns
shard` crashed the job and `--keep-columns error` had the user's values silently replaced."""

from __future__ import annotations

import pyarrow as pa
import pytest

from pipeline.stages import columns, dedupe, stage
from pipeline.stages.prompts import RowIdStage
from tests.pipeline.refusals import refusals

TABLE = "id,prompt,key,n\nr1,hello,k1,3\nr2,world,k2,4\n"


def _config(tmp_path, *flags: str, model: str = "unused"):  # noqa: ANN202 (JobConfig)
    """The job's config from `flags`; the flags are checked before `model` is looked at."""
    from jobs.generate import build_config, build_parser

    table = tmp_path / "rows.csv"
    table.write_text(TABLE)
    base = ["--input", str(table), "--output", str(tmp_path / "out"), "--model", model]
    args = [*base, *flags]
    if not {"--template", "--messages-column", "--prompt-column"} & set(flags):
        args += ["--prompt-column", "prompt"]
    return build_config(build_parser().parse_args(args))


@pytest.mark.parametrize("name", columns.RESERVED_COLUMNS)
def test_every_reserved_name_is_refused_as_text_or_kept_column(tmp_path, name):
    with pytest.raises(ValueError, match=rf"--text-column '{name}'.*the job's own columns"):
        _config(tmp_path, "--text-column", name)
    with pytest.raises(ValueError, match=rf"--keep-columns '{name}'.*the job's own columns"):
        _config(tmp_path, "--keep-columns", f"n,{name}")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--text-column", "id"], "--text-column 'id'"),
        (["--text-column", "finish_reason"], "--text-column 'finish_reason'"),
        (["--text-column", ""], "--text-column is empty"),
        (["--keep-columns", "shard"], "--keep-columns 'shard'"),
        (["--keep-columns", "prefix_key,n"], "--keep-columns 'prefix_key'"),
        (["--keep-columns", "n", "--text-column", "n"], "--keep-columns 'n'.*generated text"),
        (["--id-column", dedupe.CONTENT], f"--id-column '{dedupe.CONTENT}'"),
        (["--prompt-column", dedupe.CONTENT], f"--prompt-column '{dedupe.CONTENT}'"),
        # Another column gives the ids: the input's `id` is replaced before it could be read.
        (["--id-column", "key", "--prompt-column", "id"], "--prompt-column 'id'.*--id-column"),
        (["--id-column", "key", "--template", "{prompt} {id}"], "--template 'id'"),
        (["--id-column", "key", "--sampling-column", "id"], "--sampling-column 'id'"),
        (["--messages-column", dedupe.DEDUPE_KEY], f"--messages-column '{dedupe.DEDUPE_KEY}'"),
    ],
)
def test_clashing_flags_name_the_flag_and_the_column(tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, *flags)


def test_reading_a_column_named_like_an_output_column_is_fine(tmp_path, tiny_model_dir):
    """The input is read before the job's columns exist: a prompt in a column called `error`,
    ids from `shard`, the input's own `id` as the prompt when it is the id column."""
    model = str(tiny_model_dir)
    flags = ("--id-column", "shard", "--template", "{error} {finish_reason}")
    config = _config(tmp_path, *flags, model=model)
    assert config.prompt.template_fields == ("error", "finish_reason")
    assert _config(tmp_path, "--id-column", "id", model=model).input.id_column == "id"
    kept = _config(tmp_path, "--keep-columns", "n,n,key", model=model).input.keep_columns
    assert kept == ("n", "key")


def test_the_id_stage_replaces_an_input_column_named_like_its_content_hash():
    batch = pa.table({"id": ["a", "b"], dedupe.CONTENT: ["x", "y"], "p": ["1", "2"]})
    out = RowIdStage("id")(batch)
    assert out.column_names.count(dedupe.CONTENT) == 1
    assert out.column(stage.ID).to_pylist() == ["a", "b"]
    assert out.column(dedupe.CONTENT).to_pylist() != ["x", "y"]


def test_cli_refuses_a_clash_with_exit_2_before_ray(tiny_model_dir, tmp_path):
    table = tmp_path / "rows.csv"
    table.write_text(TABLE)
    base = ["--input", str(table), "--output", str(tmp_path / "out")]
    base += ["--model", str(tiny_model_dir), "--prompt-column", "prompt"]
    cases = (
        (["--text-column", "id"], "--text-column 'id'"),
        (["--keep-columns", "shard"], "--keep-columns 'shard'"),
    )
    runs, stderr = refusals([[*base, *flags] for flags, _ in cases])  # one process
    for run, (_, message) in zip(runs, cases, strict=True):
        assert run.returncode == 2, run.stderr[-2000:]
        assert message in run.stderr, run.stderr[-2000:]
        assert "Traceback" not in run.stderr
        assert not run.ray_started
    assert "Traceback" not in stderr
    assert not (tmp_path / "out").exists()  # before any work


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--output-column", "id"], "--output-column 'id'"),
        (["--query-column", "shard"], r"--query-column \(kept\) 'shard'"),
        (["--query-column", "snippet"], r"--query-column \(kept\) 'snippet'.*generated text"),
        (["--document-column", dedupe.CONTENT], "--document-column"),
        (["--id-column", "key", "--query-column", "id"], "--query-column 'id'"),
    ],
)
def test_snippets_names_its_own_flags(tmp_path, flags, message):
    from pipeline.commands.snippets import build_config, build_parser

    base = ["--input", str(tmp_path / "x.jsonl"), "--output", str(tmp_path / "out")]
    with pytest.raises(ValueError, match=message):
        build_config(build_parser().parse_args([*base, *flags]))
