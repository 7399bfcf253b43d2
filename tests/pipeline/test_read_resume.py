"""Finding inputs and their columns, and reading back what an output folder holds (no Ray)."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import InputConfig
from pipeline.io.read import check_columns, input_columns, resolve_input
from pipeline.io.resume import data_files, scan_output


def _columns(config: InputConfig) -> list[str]:
    return input_columns(resolve_input(config), config.hf_split)


def test_parquet_file_folder_and_glob(tmp_path):
    for i in range(2):
        pq.write_table(pa.table({"id": [i], "text": ["x"]}), tmp_path / f"part-{i}.parquet")
    (tmp_path / "_summary.json").write_text("{}")
    assert resolve_input(InputConfig(str(tmp_path))).paths == tuple(
        str(tmp_path / f"part-{i}.parquet") for i in range(2)
    )
    source = resolve_input(InputConfig(str(tmp_path / "part-*.parquet")))
    assert source.format == "parquet" and len(source.paths) == 2
    assert _columns(InputConfig(str(tmp_path / "part-0.parquet"))) == ["id", "text"]


def test_jsonl_gz_csv_and_hf_columns(tmp_path):
    path = tmp_path / "rows.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.write(json.dumps({"a": 1}) + "\n" + json.dumps({"a": 2, "b": "x"}) + "\n")
    assert resolve_input(InputConfig(str(path))).format == "jsonl"
    assert _columns(InputConfig(str(path))) == ["a", "b"]
    (tmp_path / "t.csv").write_text("q,doc\n1,2\n")
    assert _columns(InputConfig(str(tmp_path / "t.csv"))) == ["q", "doc"]

    import datasets

    datasets.Dataset.from_dict({"prompt": ["a"], "n": [1]}).save_to_disk(str(tmp_path / "hf"))
    source = resolve_input(InputConfig(str(tmp_path / "hf")))
    assert source.format == "hf"
    assert _columns(InputConfig(str(tmp_path / "hf"))) == ["prompt", "n"]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"p": ["a"]})})
    dd.save_to_disk(str(tmp_path / "hfdict"))
    assert _columns(InputConfig(str(tmp_path / "hfdict"))) == ["p"]
    with pytest.raises(ValueError, match="no split 'test'"):
        _columns(InputConfig(str(tmp_path / "hfdict"), hf_split="test"))


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("missing.parquet", "does not exist"),
        ("nothing-*.parquet", "matches no files"),
        ("empty", "holds no .parquet"),
        ("notes.txt", "cannot tell the format"),
    ],
)
def test_bad_paths_fail_with_a_message(tmp_path, path, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match=message):
        resolve_input(InputConfig(str(tmp_path / path)))


def test_missing_column_names_the_existing_ones():
    with pytest.raises(
        ValueError, match=r"no column 'query' \(used by the template\).*\['doc', 'id'\]"
    ):
        check_columns(["doc", "id"], {"doc": "x", "query": "used by the template"}, "in.parquet")


def test_scan_output_reads_ids_and_removes_only_its_own_cut_files(tmp_path):
    prefix = "raypack-abc123"
    assert scan_output(tmp_path / "nothing-yet", prefix).done_ids == frozenset()
    pq.write_table(pa.table({"id": ["a", "b"], "x": [1, 2]}), tmp_path / f"{prefix}_w1_0-0.parquet")
    pq.write_table(pa.table({"id": ["c"], "x": [3]}), tmp_path / f"{prefix}_w1_1-0.parquet")
    whole = (tmp_path / f"{prefix}_w1_1-0.parquet").read_bytes()
    (tmp_path / f"{prefix}_w1_2-0.parquet").write_bytes(whole[: len(whole) // 2])  # a killed write
    (tmp_path / "users-own.parquet").write_bytes(whole[: len(whole) // 2])  # not this job's
    open_file = tmp_path / f".{prefix}_w1_3-0.parquet.tmp"  # a writer killed with it open
    open_file.write_bytes(whole[: len(whole) // 2])
    others_open = tmp_path / ".raypack-other_w1_3-0.parquet.tmp"  # another job's, still open
    others_open.write_bytes(whole)
    pq.write_table(pa.table({"id": ["z"]}), tmp_path / "raypack-other_w1_0-0.parquet")
    (tmp_path / "_summary.json").write_text("{}")
    state = scan_output(tmp_path, prefix)
    assert state.done_ids == {"a", "b", "c"}
    assert [p.rsplit("/", 1)[1] for p in state.removed] == [
        open_file.name,
        f"{prefix}_w1_2-0.parquet",
    ]
    assert not open_file.exists() and others_open.exists()
    assert state.foreign == ("raypack-other_w1_0-0.parquet", "users-own.parquet")
    assert (tmp_path / "users-own.parquet").exists()
    assert len(data_files(tmp_path, prefix)) == 2
    assert len(data_files(tmp_path)) == 4


def test_scan_output_leaves_a_foreign_folder_alone(tmp_path):
    pq.write_table(pa.table({"x": [1]}), tmp_path / "data.parquet")
    state = scan_output(tmp_path, "raypack-abc123")
    assert state.done_ids == frozenset() and state.foreign == ("data.parquet",)
    assert (tmp_path / "data.parquet").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="--output .* is a file"):
        scan_output(tmp_path / "file", "raypack-abc123")


def test_retry_errors_drops_only_this_jobs_error_rows_from_their_files(tmp_path):
    prefix = "raypack-abc123"
    mixed = tmp_path / f"{prefix}_w1_0-0.parquet"
    pq.write_table(
        pa.table({"id": ["a", "b", "c"], "x": [1, 2, 3], "error": [None, "bad", None]}), mixed
    )
    only_errors = tmp_path / f"{prefix}_w1_1-0.parquet"
    pq.write_table(pa.table({"id": ["d"], "x": [4], "error": ["worse"]}), only_errors)
    clean = tmp_path / f"{prefix}_w1_2-0.parquet"
    pq.write_table(pa.table({"id": ["e"], "x": [5], "error": pa.array([None], pa.string())}), clean)
    theirs = tmp_path / "theirs.parquet"
    pq.write_table(pa.table({"id": ["f"], "error": ["theirs"]}), theirs)
    untouched = {p: p.read_bytes() for p in (clean, theirs)}

    assert scan_output(tmp_path, prefix).done_ids == {"a", "b", "c", "d", "e"}  # without: done
    state = scan_output(tmp_path, prefix, retry_errors=True)
    assert state.done_ids == {"a", "c", "e"} and state.retried == 2
    assert pq.read_table(mixed).to_pydict() == {"id": ["a", "c"], "x": [1, 3], "error": [None] * 2}
    assert not only_errors.exists()  # nothing but error rows: deleted
    assert {p: p.read_bytes() for p in (clean, theirs)} == untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [mixed.name, clean.name, theirs.name]
    )
    left = {p: p.read_bytes() for p in tmp_path.iterdir()}
    again = scan_output(tmp_path, prefix, retry_errors=True)  # nothing left to retry
    assert again.retried == 0 and again.done_ids == {"a", "c", "e"} and not again.removed
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == left  # nothing rewritten
