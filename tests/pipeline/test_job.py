"""The offline job end to end on a local Ray with a tiny model and fake GPU resources."""

from __future__ import annotations

import importlib.util
import json
import os
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.config import EngineConfig, SamplingParams
from pipeline.config import ComputeConfig, InputConfig, JobConfig, PlanConfig, PromptConfig
from pipeline.io.report import REPORT_FILE, SUMMARY_FILE
from pipeline.io.resume import data_files
from pipeline.job.run import run_job
from pipeline.stages.infer import InferStage
from tests.actors.reference import hf_greedy, torch_threads
from tests.pipeline.data import MALFORMED, TEMPLATE, rows

ROOT = Path(__file__).parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def make_config(
    table: Path, model_dir: Path, output: Path, num_actors: int = 1, **plan
) -> JobConfig:
    """The synthetic table through the tiny model, engine actors on fake GPUs."""
    return JobConfig(
        input=InputConfig(str(table), keep_columns=("doc_id",)),
        prompt=PromptConfig(
            template=TEMPLATE, sampling_column="sampling", override_columns=("max_tokens",)
        ),
        output=str(output),
        engine=EngineConfig(dtype="float32", model=str(model_dir), max_num_seqs=64),
        sampling=SamplingParams(max_tokens=4),
        plan=PlanConfig(**{"num_partitions": 2, **plan}),
        compute=ComputeConfig(
            num_actors=num_actors, num_cpus_per_actor=0.25, resources=(("fake_gpu", 1),)
        ),
    )


def read_output(output: Path) -> dict[str, dict]:
    """Output rows by id; fails on a duplicate id."""
    table = pq.read_table(output)  # pyarrow skips the _summary.json / _report.png files
    out: dict[str, dict] = {}
    for row in table.to_pylist():
        assert row["id"] not in out, f"id {row['id']} written twice"
        out[row["id"]] = row
    return out


def test_one_actor_every_id_once_equal_to_hf_generate(
    ray_cluster, prompt_table, tiny_model_dir, tmp_path
):
    # One partition: every row meets there without the keyed shuffle (the small-input path).
    config = make_config(prompt_table, tiny_model_dir, tmp_path / "out", num_partitions=1)
    summary = run_job(config)
    out = read_output(tmp_path / "out")
    table = rows()
    assert set(out) == {r["id"] for r in table}

    errors = {i: r["error"] for i, r in out.items() if r["error"] is not None}
    assert set(errors) == MALFORMED
    assert "is null" in errors["null-doc"]
    assert "context of 512" in errors["long-doc"]
    assert "unknown sampling override" in errors["unknown-override"]
    assert "max_tokens" in errors["bad-override"]
    assert all(out[i]["finish_reason"] == "error" for i in MALFORMED)

    # Hugging Face `generate` on each prompt alone (the template filled by str.format, the
    # row's max_tokens or the job's 4), not the job's own prompt builder or engine.
    valid = [r for r in table if r["id"] not in MALFORMED]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch_threads(1):
        for row in valid:
            got = out[row["id"]]
            ids = tokenizer.encode(TEMPLATE.format(**row), add_special_tokens=False)
            expected = hf_greedy(model, ids, row["max_tokens"] or 4)
            assert got["generated_token_ids"] == expected, row["id"]
            assert got["generated_text"] == tokenizer.decode(expected, skip_special_tokens=True)
            assert got["num_prompt_tokens"] == len(ids)
            assert got["doc_id"] == row["doc_id"]

    # Each document's rows ran as one prefix group, with its prefix served from the cache.
    by_doc = defaultdict(list)
    for row in valid:
        by_doc[row["doc_id"]].append(out[row["id"]])
    for doc, members in by_doc.items():
        if doc.startswith("short-"):  # at most the template's opening is shared
            assert members[0]["shared_prefix_len"] < 16
            continue
        assert len({m["prefix_group"] for m in members}) == 1, doc
        assert all(m["shared_prefix_len"] > 64 and m["num_cached_tokens"] > 0 for m in members)

    assert summary.rows == len(table) and summary.error_rows == len(MALFORMED)
    assert 0 < summary.prefix_saving_ratio <= summary.optimal_saving_ratio + 1e-9
    saved = json.loads((tmp_path / "out" / SUMMARY_FILE).read_text())
    assert saved["rows"] == summary.rows
    assert (tmp_path / "out" / REPORT_FILE).stat().st_size > 10_000
    # The job's start-up and tail, timed from the driver's and the engine actor's marks
    # (pipeline/job/phases.py); run_job without the command: from the job's start.
    phases = saved["phases_s"]
    assert phases == summary.phases_s
    parts = ("read_plan", "engine_start", "engine_load", "first_step", "to_first_step")
    engine_parts = ("engine_process", "engine_imports")  # engine_start's two parts
    assert set(phases) == {*parts, *engine_parts, "steps", "last_write", "report"}, phases
    assert all(v >= 0 for v in phases.values())
    # (engine_process is 0 when the actor got a worker Ray had started before the job)
    assert phases["engine_process"] + phases["engine_imports"] >= phases["engine_start"] - 0.02
    assert phases["engine_process"] <= phases["engine_start"]
    assert phases["engine_start"] + phases["engine_load"] <= phases["to_first_step"] + 0.05
    assert phases["read_plan"] <= phases["to_first_step"] + 0.05
    assert phases["to_first_step"] + phases["steps"] <= summary.wall_time_s + 0.05


def load_job(name: str):
    """jobs/<name>.py as a module (jobs/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "jobs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kill_once_stage(marker: Path) -> type[InferStage]:
    """An InferStage whose actor process dies after its first shard's generate, once."""

    class KillOnce(InferStage):
        def run_shard(self, shard):
            result = super().run_shard(shard)
            if not marker.exists():
                marker.write_text(str(os.getpid()))
                os._exit(1)
            return result

    return KillOnce


def test_snippets_two_engines_in_one_actor_groups_whole_and_killed_actor_recovered(
    ray_cluster, tiny_model_dir, tmp_path
):
    """jobs/snippets.py's config on the bundled sample with two engines in one engine actor
    (`--engines-per-actor`, as auto runs a 2-core node's), three rows per shard at most:
    documents with four queries are split (prefix repeated), all others stay in one shard.
    The actor dies mid-shard; Ray restarts it (both engines) and its shards are redone."""
    snippets = load_job("snippets")
    sample = ROOT / "jobs" / "data" / "snippets_sample.jsonl"
    output = tmp_path / "snippets"
    args = snippets.build_parser().parse_args(
        [
            "--input", str(sample), "--output", str(output), "--model", str(tiny_model_dir), "--dtype", "float32",
            "--max-tokens", "2", "--num-actors", "1", "--engines-per-actor", "2",
            "--num-cpus-per-actor", "0.5",
            "--actor-resource", "fake_gpu=1", "--max-rows-per-shard", "3",
            "--num-partitions", "2", "--keep-columns", "doc_id,query",
        ]
    )  # fmt: skip
    marker = tmp_path / "killed"
    run_job(snippets.build_config(args), infer_cls=kill_once_stage(marker))
    assert marker.exists()

    out = read_output(output)
    sample_rows = [json.loads(line) for line in sample.read_text().splitlines()]
    assert set(out) == {r["id"] for r in sample_rows}
    assert "snippet" in next(iter(out.values()))
    shards = defaultdict(set)
    counts = defaultdict(int)
    for row in out.values():
        if row["error"] is None:
            shards[row["doc_id"]].add(row["shard"])
            counts[row["doc_id"]] += 1
        else:
            assert "context of 512" in row["error"]
    assert counts, "every document was over the tiny model's context"
    for doc, n in counts.items():
        assert len(shards[doc]) == (1 if n <= 3 else 2), (doc, n, shards[doc])
    summary = json.loads((output / SUMMARY_FILE).read_text())
    assert summary["split_groups"] == sum(1 for n in counts.values() if n > 3) > 0
    # One writer for the two engines (pipeline/io/writer.py `default_num_writers`):
    # one file (`<prefix>_<run>-<writer>-<n>.parquet`), writer 0's.
    assert [p.rsplit("-", 2)[1] for p in data_files(output)] == ["0"]
