"""Resume after a killed driver, a simulated two-node cluster, fail-fast input checks and the
input formats: the parts of the job that need more than one process or no Ray at all."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.config import SamplingParams
from pipeline.config import InputConfig
from pipeline.io.read import read_dataset, resolve_input
from pipeline.io.resume import data_files
from pipeline.job.run import run_job
from pipeline.stages.prompts import RowIdStage
from tests.pipeline.data import TEMPLATE, rows
from tests.pipeline.test_job import make_config, read_output

ROOT = Path(__file__).parents[2]


def _generate():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "jobs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_after_killed_driver_has_no_duplicates_or_gaps(
    ray_cluster, prompt_table, tiny_model_dir, tmp_path
):
    """A driver (joined to the running cluster, as under `ray job submit`) is killed once its
    first shard is written; a rerun into the same folder completes the table."""
    output = tmp_path / "out"
    cmd = [
        sys.executable, "jobs/generate.py", "--input", str(prompt_table), "--output", str(output),
        "--template", TEMPLATE, "--sampling-column", "sampling", "--keep-columns", "doc_id",
        "--sampling-columns", "max_tokens",
        "--model", str(tiny_model_dir), "--dtype", "float32", "--max-tokens", "24", "--max-rows-per-shard", "2",
        "--max-rows-per-file", "4",  # files of two shards: the first comes long before the end
        "--num-partitions", "2", "--num-cpus-per-actor", "0.25", "--actor-resource", "fake_gpu=1",
    ]  # fmt: skip
    log = (tmp_path / "driver.log").open("w")
    driver = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, "RAY_ADDRESS": ray_cluster},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 200
    while not data_files(output) and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert driver.poll() is None, (
        f"the driver ended before it was killed:\n{(tmp_path / 'driver.log').read_text()[-3000:]}"
    )
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    written = sum(pq.ParquetFile(f).metadata.num_rows for f in data_files(output) if _complete(f))
    assert 0 < written < len(rows()), written

    # Shards of the default size this time: the ids written, not the shards, say what is left.
    config = make_config(prompt_table, tiny_model_dir, output)
    config = config.__class__(**{**config.__dict__, "sampling": SamplingParams(max_tokens=24)})
    summary = run_job(config)
    out = read_output(output)
    assert set(out) == {r["id"] for r in rows()}  # every id, each once
    assert summary.rows_skipped == written
    assert summary.rows == len(rows()) - written
    # the rows of both runs are right: ids and text equal Hugging Face's on each prompt alone
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.actors.reference import hf_greedy, torch_threads
    from tests.pipeline.data import MALFORMED

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch_threads(1):
        for row in rows():
            if row["id"] in MALFORMED:
                continue
            ids = tokenizer.encode(TEMPLATE.format(**row), add_special_tokens=False)
            expected = hf_greedy(model, ids, row["max_tokens"] or 24)
            got = out[row["id"]]
            assert got["generated_token_ids"] == expected, row["id"]
            assert got["generated_text"] == tokenizer.decode(expected, skip_special_tokens=True)


def _complete(path: Path) -> bool:
    try:
        pq.ParquetFile(path)
    except Exception:
        return False
    return True


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
