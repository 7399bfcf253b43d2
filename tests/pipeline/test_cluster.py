"""A simulated two-node cluster, fail-fast input checks and the input formats: the parts of the
job that need more than one process or no Ray at all.

(A driver killed once its first file is written and a rerun that completes the table, every
id once and every token Hugging Face's, is tests/pipeline/test_s3.py's
`test_s3_job_killed_and_resumed`: the same job and resume code, with the input, output and
model on S3. Until 2026-11-26 a local copy of it ran here too (~40 s of the suite); what only
a local folder has, a file left open by a killed writer and removed by the rerun's scan, is
test_output_files.py's `test_writer_files_appear_whole_and_a_killed_writer_loses_nothing`.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import InputConfig
from pipeline.io.read import read_dataset, resolve_input
from pipeline.stages.prompts import RowIdStage
from tests.pipeline.data import rows
from tests.pipeline.test_job import read_output

ROOT = Path(__file__).parents[2]


def _generate():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "jobs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_simulated_nodes_dp_and_pp_stages(prompt_table, tiny_model_dir, tmp_path):
    """read -> plan -> infer -> write on a two-node cluster: two engine actors (one per node),
    then one pp=2 engine whose stages are on different nodes, in 7-token prefill chunks; every
    id once in each, and the pp engine's tokens equal the single-process engines' (whole
    prompts: chunked across nodes equals whole in one process)."""
    output = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "tests/pipeline/two_node_job.py", str(prompt_table), str(tiny_model_dir), str(output)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((output / "result.json").read_text())
    assert result["nodes"] == 2, result
    assert result["dp_rows"] == result["pp_rows"] == len(rows()), result
    assert len(set(result["stage_nodes"])) == 2, result  # stage 0 and stage 1 apart
    got, expected = read_output(output / "pp"), read_output(output / "dp")
    assert set(got) == set(expected) == {r["id"] for r in rows()}
    for row_id, row in got.items():
        assert row["generated_token_ids"] == expected[row_id]["generated_token_ids"], row_id
        assert row["error"] == expected[row_id]["error"], row_id
    assert any(row["shared_prefix_len"] for row in got.values())  # prefix groups crossed too


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--input", "nowhere/prompts.parquet", "--prompt-column", "p"], "does not exist"),
        (
            ["--prompt-column", "prompt"],
            "no column 'prompt' (the prompt source). Its columns: ['id', 'doc_id'",
        ),
        (["--template", "{document} {title}"], "no column 'title' (used by the template)"),
        (
            ["--prompt-column", "query", "--keep-columns", "author"],
            "no column 'author' (asked to keep)",
        ),
        (["--prompt-column", "query", "--id-column", "key"], "no column 'key' (the id column)"),
        (["--prompt-column", "query", "--model", "/no/such/model"], "neither 'smollm2'"),
    ],
)
def test_bad_input_fails_fast_naming_the_columns(prompt_table, tmp_path, capsys, args, message):
    if "--input" not in args:
        args = ["--input", str(prompt_table), *args]
    output = tmp_path / "out"
    assert _generate().main([*args, "--output", str(output)]) == 2
    assert message in capsys.readouterr().err
    assert not output.exists()  # nothing started, nothing written


@pytest.mark.timeout(120)
def test_parquet_jsonl_csv_and_hf_inputs_read_with_ids(ray_cluster, tmp_path):
    import ray.data

    table = [r for r in rows() if r["document"]][:5]
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "t.parquet")
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in table))
    (tmp_path / "t.csv").write_text(
        "id,query\n" + "".join(f"{r['id']},{r['query']}\n" for r in table)
    )
    datasets.Dataset.from_list(table).save_to_disk(str(tmp_path / "hf"))
    context = ray.data.DataContext.get_current()
    assert context.use_datasource_v2  # Ray's default, which the job's read sets aside
    for name in ("t.parquet", "t.jsonl", "t.csv", "hf"):
        source = resolve_input(InputConfig(str(tmp_path / name)))
        ds = read_dataset(source, None, num_cpus=0.25, rows_per_block=2)
        got = ds.map_batches(RowIdStage("id"), batch_format="pyarrow", batch_size=None)
        got = got.materialize()
        assert sorted(got.to_pandas()["id"]) == sorted(r["id"] for r in table), name
        if name == "t.parquet":  # V1's reader: no ListFiles operator and its 32 footer actors
            assert "ReadParquet" in got.stats() and "ListFiles" not in got.stats()
    assert context.use_datasource_v2  # the user's setting is left as it was
