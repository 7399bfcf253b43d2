"""A user id that repeats: identical rows come out once, rows with different content are
error rows (or, with on_duplicate="first", the first one read is generated), never dropped
silently, also when the copies are in different read blocks and partitions."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.config import EngineConfig, SamplingParams
from pipeline.config import ComputeConfig, InputConfig, JobConfig, PlanConfig, PromptConfig
from pipeline.job.run import run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# "a" and "b" appear twice, with another prompt the second time, each time in another block
# of two rows (rows_per_block=2); "c" twice, identical.
ROWS = [
    ("a", "The first note says the sky is blue. What colour is the sky?"),
    ("b", "The second note is about trains and timetables. When do they leave?"),
    ("a", "A different prompt that reuses the id a. Say something."),
    ("c", "The third note lists fruit: apples, pears and plums. Name one."),
    ("b", "Yet another prompt, reusing the id b, about the weather today."),
    ("d", "The fourth note: a recipe for bread with flour, water and salt."),
    ("c", "The third note lists fruit: apples, pears and plums. Name one."),
]


@pytest.mark.parametrize(
    ("grouping", "on_duplicate"),
    [(True, "error"), (False, "error"), (True, "first")],
    ids=["grouping", "no-grouping", "first"],
)
def test_repeated_ids_identical_once_different_never_silently_dropped(
    ray_cluster, tiny_model_dir: Path, tmp_path: Path, grouping: bool, on_duplicate: str
):
    table = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"key": [r[0] for r in ROWS], "text": [r[1] for r in ROWS]}), table)
    config = JobConfig(
        input=InputConfig(str(table), id_column="key", keep_columns=("text",)),
        prompt=PromptConfig(prompt_column="text"),
        output=str(tmp_path / "out"),
        engine=EngineConfig(dtype="float32", model=str(tiny_model_dir), max_num_seqs=16),
        sampling=SamplingParams(max_tokens=2),
        plan=PlanConfig(
            prefix_grouping=grouping, num_partitions=2, key_block_size=4, on_duplicate=on_duplicate
        ),
        compute=ComputeConfig(
            num_actors=1, num_cpus_per_actor=0.25, resources=(("fake_gpu", 1),), rows_per_block=2
        ),
    )
    summary = run_job(config)
    out = pq.read_table(tmp_path / "out").to_pylist()
    by_id: dict[str, list[dict]] = {}
    for row in out:
        by_id.setdefault(row["id"], []).append(row)
    assert sorted(by_id) == ["a", "b", "c", "d"]
    for unique in ("c", "d"):  # "c" twice, identical: generated once
        assert len(by_id[unique]) == 1 and by_id[unique][0]["error"] is None
    if on_duplicate == "first":
        for repeated in ("a", "b"):
            (row,) = by_id[repeated]  # one version generated (the first registered), no error
            assert row["error"] is None
            assert row["text"] in [t for i, t in ROWS if i == repeated]
        assert summary.duplicate_rows == 3  # a's and b's other version, c's copy
        return
    for repeated in ("a", "b"):
        rows = by_id[repeated]
        # every version comes back exactly once: none dropped
        assert sorted(r["text"] for r in rows) == sorted(t for i, t in ROWS if i == repeated)
        errors = [r["error"] for r in rows]
        if grouping:  # the shuffle is a barrier: every version is known, each an error row
            assert all("2 input rows with different content" in e for e in errors), errors
            # A version read in a later block than the first is described by its text (the
            # first version only by its content hash: see pipeline/stages/dedupe.py).
            named = [
                next(t for i, t in ROWS if i == repeated and t != row["text"])[:40] in error
                for row, error in zip(rows, errors, strict=True)
            ]
            assert any(named), errors
        else:  # no barrier: the version planned later is an error row at least
            assert any(e and "with different content" in e for e in errors), errors
    assert summary.duplicate_rows == 1  # c's identical copy
