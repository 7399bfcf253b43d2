"""A user id that repeats in two read blocks (two partitions) comes out once, not twice."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.config import EngineConfig, SamplingParams
from pipeline.config import ComputeConfig, InputConfig, JobConfig, PlanConfig, PromptConfig
from pipeline.job import run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# "a" and "b" appear twice, with another prompt the second time, each time in another block
# of two rows (rows_per_block=2).
ROWS = [
    ("a", "The first note says the sky is blue. What colour is the sky?"),
    ("b", "The second note is about trains and timetables. When do they leave?"),
    ("a", "A different prompt that reuses the id a. Say something."),
    ("c", "The third note lists fruit: apples, pears and plums. Name one."),
    ("b", "Yet another prompt, reusing the id b, about the weather today."),
    ("d", "The fourth note: a recipe for bread with flour, water and salt."),
]


@pytest.mark.parametrize("grouping", [True, False], ids=["grouping", "no-grouping"])
def test_an_id_repeated_across_blocks_is_written_once(
    ray_cluster, tiny_model_dir: Path, tmp_path: Path, grouping: bool
):
    table = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"key": [r[0] for r in ROWS], "text": [r[1] for r in ROWS]}), table)
    config = JobConfig(
        input=InputConfig(str(table), id_column="key"),
        prompt=PromptConfig(prompt_column="text"),
        output=str(tmp_path / "out"),
        engine=EngineConfig(model=str(tiny_model_dir), max_num_seqs=16),
        sampling=SamplingParams(max_tokens=2),
        plan=PlanConfig(prefix_grouping=grouping, num_partitions=2, key_block_size=4),
        compute=ComputeConfig(
            num_actors=1, num_cpus_per_actor=0.25, resources=(("fake_gpu", 1),), rows_per_block=2
        ),
    )
    summary = run_job(config)
    ids = pq.read_table(tmp_path / "out").column("id").to_pylist()
    assert sorted(ids) == ["a", "b", "c", "d"]
    assert summary.duplicate_rows == 2
