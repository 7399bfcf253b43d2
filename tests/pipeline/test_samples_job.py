"""Several samples per row (`n`) through the engine stage and the offline job: one output row
per sample with the row's id and a `sample_index`, the prompt prefilled once (the samples'
prompt tokens cached), greedy samples equal to Hugging Face `generate`, and a rerun that
writes nothing twice."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from actors import LLMEngine
from actors.config import EngineConfig, SamplingParams
from actors.loader import load_tokenizer
from pipeline.config import ComputeConfig, InputConfig, JobConfig, PlanConfig, PromptConfig
from pipeline.job.run import run_job
from pipeline.stages import stage
from pipeline.stages.infer import InferStage
from pipeline.stages.plan import plan_partition
from tests.actors.reference import hf_greedy, torch_threads
from tests.pipeline.test_plan_infer import DOC_A, tokenized
from tests.tiny_models import tiny_model

MAX_TOKENS = 4


def test_engine_stage_writes_a_row_per_sample_with_one_prefill_each():
    rows = [
        ("bad", None, "prompt is empty"),
        ("a0", DOC_A + [1], None),
        ("a1", DOC_A + [2, 3], None),
        ("solo", [5, 6, 7], None),
    ]
    sampling = [None, '{"n": 3}', None, '{"n": 2, "temperature": 1.0, "seed": 5}']
    defaults = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    shards, _ = plan_partition(tokenized(rows, sampling), PlanConfig(), defaults, ["doc"])
    model = tiny_model()  # the reference; the engine gets its own copy (same weights)
    engine = LLMEngine(
        EngineConfig(dtype="float32", num_kv_blocks=256),
        model=tiny_model(),
        tokenizer=load_tokenizer("smollm2"),
    )
    infer = InferStage(
        EngineConfig(dtype="float32"),
        defaults,
        keep_columns=["doc"],
        with_samples=True,
        engine=engine,
    )
    with torch_threads(1):
        out = infer(shards).to_pylist()
        expected = {i: hf_greedy(model, t, MAX_TOKENS) for i, t, _ in rows[1:3]}
    by_id: dict[str, list[dict]] = {}
    for row in out:
        by_id.setdefault(row[stage.ID], []).append(row)
    assert {i: [r[stage.SAMPLE_INDEX] for r in rs] for i, rs in by_id.items()} == {
        "bad": [0],
        "a0": [0, 1, 2],
        "a1": [0],
        "solo": [0, 1],
    }
    assert by_id["bad"][0][stage.ERROR] == "prompt is empty"
    for row_id in ("a0", "a1"):
        assert all(r[stage.GENERATED_TOKEN_IDS] == expected[row_id] for r in by_id[row_id])
        assert all(r["doc"] == by_id[row_id][0]["doc"] for r in by_id[row_id])
    # a0's samples nest in the planner's group of a0 and a1: each has its prompt but the
    # last token from the shared prefill; a1 has the group's prefix.
    assert [r[stage.NUM_CACHED_TOKENS] for r in by_id["a0"]] == [len(DOC_A)] * 3
    assert by_id["a1"][0][stage.NUM_CACHED_TOKENS] == by_id["a1"][0][stage.SHARED_PREFIX_LEN]
    assert [r[stage.NUM_CACHED_TOKENS] for r in by_id["solo"]] == [2, 2]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_job_n2_one_row_per_sample_and_a_rerun_adds_nothing(ray_cluster, tiny_model_dir, tmp_path):
    table = tmp_path / "in.jsonl"
    prompts = {"p0": "Once upon a time", "p1": "The capital of France is", "p2": "Hello"}
    table.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in prompts.items()))
    config = JobConfig(
        input=InputConfig(str(table)),
        prompt=PromptConfig(prompt_column="text"),
        output=str(tmp_path / "out"),
        engine=EngineConfig(dtype="float32", model=str(tiny_model_dir), max_num_seqs=16),
        sampling=SamplingParams(max_tokens=MAX_TOKENS, n=2, ignore_eos=True),
        plan=PlanConfig(num_partitions=1),
        compute=ComputeConfig(num_actors=1, num_cpus_per_actor=0.25, resources=(("fake_gpu", 1),)),
    )
    run_job(config)
    first = pq.read_table(tmp_path / "out").to_pylist()
    keys = sorted((r[stage.ID], r[stage.SAMPLE_INDEX]) for r in first)
    assert keys == [(i, s) for i in sorted(prompts) for s in (0, 1)]
    tokenizer = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch_threads(1):
        for row in first:
            ids = tokenizer(prompts[row[stage.ID]])["input_ids"]
            assert row[stage.GENERATED_TOKEN_IDS] == hf_greedy(model, ids, MAX_TOKENS)
            assert row[stage.NUM_CACHED_TOKENS] == len(ids) - 1
    summary = run_job(config)
    assert summary.rows_skipped == len(first)
    again = pq.read_table(tmp_path / "out").to_pylist()
    assert sorted((r[stage.ID], r[stage.SAMPLE_INDEX]) for r in again) == keys


def test_retry_errors_drops_every_sample_of_a_row_with_an_error(tmp_path):
    import pyarrow as pa

    from pipeline.io.resume import _drop_error_rows

    path = tmp_path / "part.parquet"
    table = pa.table(
        {
            stage.ID: ["a", "a", "b", "b", "c"],
            stage.SAMPLE_INDEX: [0, 1, 0, 1, 0],
            stage.ERROR: [None, "postprocessing failed", None, None, "prompt is empty"],
        }
    )
    pq.write_table(table, path)
    assert _drop_error_rows(str(path), pq.ParquetFile(path)) == 3
    kept = pq.read_table(path).to_pylist()
    assert [(r[stage.ID], r[stage.SAMPLE_INDEX]) for r in kept] == [("b", 0), ("b", 1)]


def test_n_and_best_of_flags():
    from pipeline.commands.generate import build_config, build_parser

    base = ["--input", "in.jsonl", "--output", "out", "--prompt-column", "p"]
    config = build_config(build_parser().parse_args([*base, "--n", "2", "--best-of", "3"]))
    assert (config.sampling.n, config.sampling.best_of) == (2, 3)
    assert build_config(build_parser().parse_args(base)).sampling.num_samples == 1
    with pytest.raises(ValueError, match="best_of must be an integer in \\[4"):
        build_config(build_parser().parse_args([*base, "--n", "4", "--best-of", "3"]))
