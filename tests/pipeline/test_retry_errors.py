"""`--retry-errors` end to end: a job where some rows end with an error (a per-row max_tokens
out of range), the input fixed, a rerun with retry_errors: every id exactly once, the former
error rows generated (tokens equal the engine's on each prompt alone), nothing else redone.
(A rerun with nothing left to retry: tests/pipeline/test_read_resume.py's scan finds nothing
to retry, retried == 0, and a rerun of a finished folder writes nothing, test_output_files.py.)"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.config import EngineConfig, SamplingParams
from pipeline.config import ComputeConfig, InputConfig, JobConfig, PlanConfig, PromptConfig
from pipeline.job.run import run_job
from tests.pipeline.test_job import read_output

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROMPTS = {
    "ok-1": "The first note says the sky is blue. What colour is the sky?",
    "bad-1": "The second note is about trains. When do they leave?",
    "ok-2": "The third note lists fruit: apples and pears. Name one.",
    "bad-2": "The fourth note: bread needs flour and water. What else?",
    "ok-3": "The fifth note: the sea is salty. Why?",
}
BAD = {"bad-1", "bad-2"}


def _write(path: Path, bad_max_tokens: int) -> None:
    ids = list(PROMPTS)
    max_tokens = [bad_max_tokens if i in BAD else None for i in ids]
    table = pa.table(
        {
            "id": ids,
            "prompt": list(PROMPTS.values()),
            "max_tokens": pa.array(max_tokens, pa.int64()),
        }
    )
    pq.write_table(table, path)


def test_retry_errors_regenerates_only_error_rows_each_id_once(
    ray_cluster, tiny_model_dir, tmp_path
):
    from actors import LLMEngine

    table, out = tmp_path / "in.parquet", tmp_path / "out"
    _write(table, bad_max_tokens=-1)
    config = JobConfig(
        input=InputConfig(str(table)),
        prompt=PromptConfig(prompt_column="prompt", override_columns=("max_tokens",)),
        output=str(out),
        engine=EngineConfig(dtype="float32", model=str(tiny_model_dir), max_num_seqs=16),
        sampling=SamplingParams(max_tokens=3),
        plan=PlanConfig(num_partitions=1),
        compute=ComputeConfig(num_actors=1, num_cpus_per_actor=0.25, resources=(("fake_gpu", 1),)),
    )
    run_job(config)
    first = read_output(out)
    assert {i for i, r in first.items() if r["error"] is not None} == BAD
    assert all("max_tokens" in first[i]["error"] for i in BAD)

    _write(table, bad_max_tokens=2)  # the input fixed
    summary = run_job(replace(config, retry_errors=True))
    assert (summary.rows, summary.rows_skipped, summary.error_rows) == (len(BAD), 3, 0)
    final = read_output(out)  # fails on an id written twice
    assert set(final) == set(PROMPTS)
    for row_id in set(PROMPTS) - BAD:
        assert final[row_id] == first[row_id]  # kept as they were, not redone
    engine = LLMEngine(EngineConfig(dtype="float32", model=str(tiny_model_dir)))
    for row_id in BAD:
        alone = engine.generate([PROMPTS[row_id]], SamplingParams(max_tokens=2))[0]
        assert final[row_id]["error"] is None, final[row_id]["error"]
        assert final[row_id]["generated_token_ids"] == list(alone.token_ids), row_id
