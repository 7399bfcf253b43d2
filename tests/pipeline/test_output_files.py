"""Output files sized by rows (pipeline/io/writer.py) and resume state that keeps no id on the
driver (pipeline/io/done_ids.py): many shards in few files, files visible only when complete,
a writer killed with a file open loses nothing for the next run, a rerun writes nothing."""

from __future__ import annotations

import math
import pickle
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import FilesConfig
from pipeline.io.done_ids import DoneIds, done_filter
from pipeline.io.output import TMP_SUFFIX
from pipeline.io.resume import data_files, scan_output
from pipeline.job.run import run_job
from tests.pipeline.data import rows
from tests.pipeline.test_job import make_config, read_output

PREFIX = "raypack-abc123"


def _shard(shard_id: str, ids: list[str], note: list[str | None] | None = None) -> pa.Table:
    """A shard's rows; `note` None: an all-null column of Arrow's null type."""
    notes = pa.array(note, pa.string()) if note is not None else pa.nulls(len(ids))
    return pa.table({"id": ids, "note": notes, "shard": [shard_id] * len(ids)})


def test_done_ids_test_membership_and_travel_without_their_array():
    done = DoneIds.of(["a", "b", "row-7", "a"])
    assert len(done) == 3
    assert all(i in done for i in ("a", "b", "row-7")) and "c" not in done and "" not in done
    assert "x" not in DoneIds(0) and not DoneIds(0)
    shipped = DoneIds(5, ref="a-ref")  # a ray.ObjectRef in the job
    shipped._array = done.array  # as after a task's first look
    assert pickle.loads(pickle.dumps(shipped))._array is None  # only the ref travels
    assert pickle.loads(pickle.dumps(done))._array is not None


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_writer_files_appear_whole_and_a_killed_writer_loses_nothing(ray_cluster, tmp_path):
    import ray

    from pipeline.io.writer import FileWriter

    files = FilesConfig(max_rows_per_file=5)
    writer = ray.remote(num_cpus=0, max_restarts=0)(FileWriter).remote(
        str(tmp_path), PREFIX, "run1", 0, files
    )
    s1 = _shard("s1", ["a", "b"], ["x", None])
    assert ray.get(writer.append.remote(["s1"], s1)) == 2
    assert ray.get(writer.append.remote(["s1"], s1)) == 0  # a retried write: ignored
    assert data_files(tmp_path) == []  # nothing visible while the file is open
    # a shard whose column is all null (Arrow's null type) goes in as the file's type
    ray.get(writer.append.remote(["s2"], _shard("s2", ["c", "d"])))
    s3_s4 = pa.concat_tables([_shard("s3", ["e"], ["y"]), _shard("s4", ["f", "g"], ["z", "w"])])
    ray.get(writer.append.remote(["s3", "s4"], s3_s4))
    first = data_files(tmp_path, PREFIX)
    assert len(first) == 1  # closed at 5 rows: a, b, c, d, e
    table = pq.read_table(first[0])
    assert table.column("id").to_pylist() == ["a", "b", "c", "d", "e"]
    assert table.column("note").to_pylist() == ["x", None, None, None, "y"]
    ray.get(writer.append.remote(["s5"], _shard("s5", ["h"], ["v"])))
    ray.kill(writer)  # with f, g, h in its open file, as when the driver is killed
    left = [p for p in tmp_path.iterdir() if p.name.endswith(TMP_SUFFIX)]
    assert len(left) == 1 and left[0].name.startswith(f".{PREFIX}_run1-0-")

    state = scan_output(tmp_path, PREFIX)  # the next run
    assert state.removed == (str(left[0]),) and not left[0].exists()
    assert state.files == tuple(first) and state.num_done == 5
    done = done_filter(state.files, state.num_done)  # built by a Ray task
    assert [i in done for i in "abcdefgh"] == [True] * 5 + [False] * 3
    assert done.count == 5

    writer = ray.remote(num_cpus=0)(FileWriter).remote(str(tmp_path), PREFIX, "run2", 0, files)
    ray.get(writer.append.remote(["big"], _shard("big", [f"z{i}" for i in range(7)])))
    closed = ray.get(writer.close.remote())  # a shard over the limit gets a file of its own
    assert [rows for _, rows in closed] == [7]
    assert len(data_files(tmp_path, PREFIX)) == 2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sink_streams_the_write_and_holds_no_result_per_block(ray_cluster, tmp_path):
    """ShardSink.write: every shard's rows in the files once, the row count summed from the
    write tasks as they end (at most 2 per writer at once); the written Dataset keeps no block
    (the driver would pin each one's lineage, as `write_datasink`'s materialized output did); a
    failing write ends the writers with no file made visible."""
    import ray
    import ray.data

    from pipeline.io.writer import ShardSink

    shards = [_shard(f"s{i}", [f"r{i}-{j}" for j in range(3)], ["n"] * 3) for i in range(8)]
    ds = ray.data.from_arrow(shards)  # one block per shard, as after the plan
    sink = ShardSink(str(tmp_path), PREFIX, FilesConfig(max_rows_per_file=10), 2)
    written = sink.write(ds, num_cpus=0.5)
    assert sink.rows == 24
    assert sum(rows for _, rows in sink.committed) == 24
    ids = pa.concat_tables(pq.read_table(f) for f in data_files(tmp_path, PREFIX))["id"]
    assert sorted(ids.to_pylist()) == sorted(f"r{i}-{j}" for i in range(8) for j in range(3))
    assert written._write_ds is None and not written._has_computed_output()
    assert any(
        "write_shards" in op.operator_name for op in written.get_stats_summary().operators_stats
    )
    write_op = written._logical_plan.dag  # at most 2 write tasks per writer at once
    assert "write_shards" in write_op.name
    assert write_op.compute == ray.data.TaskPoolStrategy(size=4) and sink.max_tasks == 4
    for writer in sink.writers:  # ended
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(writer.close.remote())

    def fail(batch: pa.Table) -> pa.Table:
        if "s5" in batch.column("shard").to_pylist():
            raise ValueError("a shard that cannot be written")
        return batch

    other = tmp_path / "failed"
    other.mkdir()
    sink = ShardSink(str(other), PREFIX, FilesConfig(max_rows_per_file=100), 1)
    with pytest.raises(Exception, match="a shard that cannot be written"):
        sink.write(ds.map_batches(fail, batch_format="pyarrow", batch_size=None), num_cpus=0.5)
    assert data_files(other, PREFIX) == [] and sink.committed == []
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(sink.writers[0].close.remote())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_many_shards_in_few_files_and_a_rerun_writes_nothing(
    ray_cluster, prompt_table, tiny_model_dir, tmp_path
):
    """Two-row shards (over 20 of them) into files of at most 6 rows: each file but a writer's
    last holds 5 or 6 rows (whole shards), every id once; a rerun finds everything done and
    starts no actor (no tokenizer, engine, writer or stats actor: nothing is left to do)."""
    from ray._private.state import actors

    output = tmp_path / "out"
    config = make_config(prompt_table, tiny_model_dir, output, max_rows_per_shard=2)
    config = replace(config, files=FilesConfig(max_rows_per_file=6, num_writers=2))
    summary = run_job(config)
    n = len(rows())
    assert summary.rows == n and summary.num_shards > n // 2
    files = data_files(output)
    counts = sorted(pq.ParquetFile(f).metadata.num_rows for f in files)
    assert sum(counts) == n and max(counts) <= 6
    assert all(c >= 5 for c in counts[2:]), counts  # all but each writer's last file are full
    assert math.ceil(n / 6) <= len(files) <= math.ceil(n / 5) + 2, counts
    out = read_output(output)  # fails on an id written twice
    assert set(out) == {r["id"] for r in rows()}
    for f in files:  # a shard's rows are in one file
        shards = set(pq.read_table(f, columns=["shard"]).column("shard").to_pylist())
        assert not shards & {s for g in files if g != f for s in _shards(g)}
    before = {f: Path(f).read_bytes() for f in files}

    started = set(actors())
    again = run_job(config)
    assert (again.rows, again.rows_skipped) == (0, n)
    assert set(actors()) == started
    assert {f: Path(f).read_bytes() for f in data_files(output)} == before


def _shards(path: str) -> set[str]:
    return set(pq.read_table(path, columns=["shard"]).column("shard").to_pylist())


def _ending_in_zero(count: int) -> list[str]:
    """Ids whose 16-byte digest ends in a zero byte (numpy hands such items out cut short)."""
    from pipeline.io.id_table import digest

    found = (f"id{i}" for i in range(100_000) if digest(f"id{i}")[-1] == 0)
    return [next(found) for _ in range(count)]


def test_done_ids_find_digests_that_end_in_zero_bytes():
    zeros = _ending_in_zero(3)
    done = DoneIds.of([*zeros, "a"])
    assert all(i in done for i in zeros) and "a" in done and "b" not in done


def test_id_table_keeps_first_contents_and_claims_across_merges(monkeypatch):
    from pipeline.io import id_table
    from pipeline.io.report import StatsCollector

    monkeypatch.setattr(id_table, "MERGE_AT", 4)  # merge into the sorted arrays often
    collector = StatsCollector()
    ids = [*_ending_in_zero(2), *(f"r{i}" for i in range(10))]
    assert collector.register_rows(ids, [f"{i:020x}" for i in range(12)]) == [False] * 12
    assert collector.register_rows(ids[:2], ["0" * 20, "f" * 20]) == [False, True]
    assert collector.versions(ids) == {ids[1]: [(f"{1:020x}", None), ("f" * 20, None)]}
    assert collector.claim_ids("p1", ids[:6]) == [True] * 6
    assert collector.claim_ids("p2", ids[4:]) == [False, False] + [True] * 6
    assert collector.claim_ids("p1", ids) == [True] * 6 + [False] * 6  # a retried plan task
    assert collector.claim_ids("p3", ["new", ids[0]]) == [True, False]
    assert len(collector._ids) == 13
