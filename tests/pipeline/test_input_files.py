"""Every input file a user has (issue 31 items 3, 4, 7, 8, 11): read correctly or refused
before any work with a message naming the file (and the line for text), never a traceback
from inside the job."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.config import EngineConfig, SamplingParams
from pipeline.config import ComputeConfig, InputConfig, JobConfig, PlanConfig, PromptConfig
from pipeline.io.read import check_input, input_columns, resolve_input

BOM = b"\xef\xbb\xbf"


def _source(path: Path, exclude: Path | None = None):  # noqa: ANN202 (InputSource)
    return resolve_input(InputConfig(str(path)), exclude=str(exclude) if exclude else None)


def _check(path: Path) -> None:
    source = _source(path)
    input_columns(source)
    check_input(source)


def test_a_utf8_bom_is_skipped_and_utf16_is_refused(tmp_path):
    csv_path = tmp_path / "bom.csv"
    csv_path.write_bytes(BOM + b"prompt,id\nhello,u1\n")
    source = _source(csv_path)
    assert input_columns(source) == ["prompt", "id"]  # was ['\ufeffprompt', 'id']
    check_input(source)
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(BOM + b'{"prompt": "hello", "id": "u1"}\n')
    assert input_columns(_source(jsonl)) == ["prompt", "id"]
    check_input(_source(jsonl))  # was "line 1 is not JSON"
    for name, encoding in (("w.csv", "utf-16"), ("w.jsonl", "utf-16"), ("w32.csv", "utf-32")):
        wide = tmp_path / name
        text = "prompt,id\nhello,u1\n" if name.endswith("csv") else '{"prompt": "x"}\n'
        wide.write_bytes(text.encode(encoding))
        label = encoding.upper()
        with pytest.raises(ValueError, match=rf"{name}: {label} text .*save the file as UTF-8"):
            _check(wide)


def test_the_check_counts_the_rows_a_reader_gets(tmp_path):
    """`check_input` counts the rows (a rerun compares them with the rows done): a CSV's
    records after the header (a quoted value over two lines is one, a blank line none), a
    JSONL's non-blank lines, Parquet's footer over several files; none for a saved dataset."""
    csv_path = tmp_path / "a.csv"
    csv_path.write_text('prompt,id\n"two\nlines",u1\n\nplain,u2\n')
    assert check_input(_source(csv_path)).num_rows == 2
    jsonl = tmp_path / "b" / "b.jsonl"
    jsonl.parent.mkdir()
    jsonl.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": "c"}')
    assert check_input(_source(jsonl)).num_rows == 3
    folder = tmp_path / "pq"
    folder.mkdir()
    for i, n in enumerate((3, 4)):
        pq.write_table(pa.table({"prompt": [f"p{j}" for j in range(n)]}), folder / f"{i}.parquet")
    assert check_input(_source(folder)).num_rows == 7


def test_a_folder_of_several_formats_is_refused_naming_them(tmp_path):
    (tmp_path / "a.csv").write_text("prompt\nx\n")
    (tmp_path / "b.jsonl").write_text('{"prompt": "y"}\n')
    with pytest.raises(ValueError, match=r"mixes file formats: 1 csv \(a\.csv\); 1 jsonl \(b\."):
        _source(tmp_path)
    (tmp_path / "b.jsonl").unlink()
    pq.write_table(pa.table({"prompt": ["y"]}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"1 csv \(a\.csv\); 1 parquet \(b\.parquet\)"):
        _source(tmp_path)  # was "b.parquet: not UTF-8 text"
    assert _source(tmp_path / "*.csv").paths == (str(tmp_path / "a.csv"),)


def test_a_column_of_two_json_types_is_refused_naming_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "x"}\n\n{"prompt": {"text": "y"}}\n')
    with pytest.raises(
        ValueError, match=r"rows\.jsonl: line 3: column 'prompt' holds an object, but a string on"
    ):
        _check(path)
    rows = [
        {"messages": [{"role": "user", "content": "hi"}], "n": 1, "x": None},
        {"messages": [{"role": "user", "content": [{"type": "text"}]}], "n": 1.5, "x": "a"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        ValueError, match=r"line 2: column 'messages' \(at /messages/\[\]/content\)"
    ):
        _check(path)
    rows[1]["messages"] = []  # an integer then a float, a null then text: one type each
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _check(path)
    # Across files: each file alone is fine, together they are not.
    folder = tmp_path / "two"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"prompt": "x"}\n')
    (folder / "b.jsonl").write_text('{"prompt": 3}\n')
    with pytest.raises(ValueError, match=r"b\.jsonl: line 1: .* a string on line 1 of .*a\.jsonl"):
        _check(folder)


def _corrupt_pages(path: Path) -> None:
    table = pa.table(
        {"id": [f"r{i}" for i in range(500)], "prompt": [f"p {i} " * 5 for i in range(500)]}
    )
    pq.write_table(table, path, compression="snappy", use_dictionary=False)
    column = pq.read_metadata(path).row_group(0).column(1)
    data = bytearray(path.read_bytes())
    middle = column.data_page_offset + column.total_compressed_size // 2
    for i in range(middle, middle + 32):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def test_parquet_with_corrupt_pages_or_cut_is_refused_naming_the_file(tmp_path):
    bad = tmp_path / "pages.parquet"
    _corrupt_pages(bad)
    assert input_columns(_source(bad)) == ["id", "prompt"]  # the footer is intact
    with pytest.raises(ValueError, match=r"pages\.parquet: row group 0 of 1 cannot be read"):
        check_input(_source(bad))
    cut = tmp_path / "cut.parquet"
    pq.write_table(pa.table({"id": ["a"]}), cut)
    cut.write_bytes(cut.read_bytes()[:-30])
    with pytest.raises(ValueError, match=r"input .*cut\.parquet: not a readable parquet file"):
        input_columns(_source(cut))  # the first file's schema: was pyarrow's bare message
    binary = tmp_path / "x.csv"
    binary.write_bytes(b"prompt\n\xff\xfe\xfa\n")
    with pytest.raises(ValueError, match=r"x\.csv: not UTF-8 text"):
        _check(binary)


def test_the_output_folder_inside_the_input_is_no_input(tmp_path):
    (tmp_path / "rows.csv").write_text("prompt\nx\n")
    (tmp_path / "out").mkdir()
    pq.write_table(pa.table({"id": ["a"]}), tmp_path / "out" / "raypack-x.parquet")
    assert _source(tmp_path, exclude=tmp_path / "out").paths == (str(tmp_path / "rows.csv"),)
    with pytest.raises(ValueError, match="mixes file formats"):
        _source(tmp_path)  # the first audit's rerun: read its own Parquet output as input
    with pytest.raises(ValueError, match=r"every file is inside --output"):
        _source(tmp_path / "out", exclude=tmp_path / "out")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bom_csv_with_the_output_inside_its_folder_runs_and_reruns(
    ray_cluster, tiny_model_dir, tmp_path
):
    """A CSV with a UTF-8 BOM keeps the user's ids (they were content hashes), and --output
    inside the input folder reruns (it exited 1 reading its own output)."""
    from pipeline.job.run import run_job

    folder = tmp_path / "in"
    folder.mkdir()
    rows = [f"u{i},Note {i}: the sky is blue. What colour is the sky?" for i in range(6)]
    (folder / "rows.csv").write_bytes(BOM + ("id,prompt\n" + "\n".join(rows) + "\n").encode())
    config = JobConfig(
        input=InputConfig(str(folder)),
        prompt=PromptConfig(prompt_column="prompt"),
        output=str(folder / "out"),
        engine=EngineConfig(dtype="float32", model=str(tiny_model_dir), max_num_seqs=8),
        sampling=SamplingParams(max_tokens=2),
        plan=PlanConfig(num_partitions=1),
        compute=ComputeConfig(num_actors=1, num_cpus_per_actor=0.25, resources=(("fake_gpu", 1),)),
    )
    first = run_job(config)
    again = run_job(config)
    ids = pq.read_table(folder / "out", ignore_prefixes=[".", "_"]).column("id").to_pylist()
    assert sorted(ids) == [f"u{i}" for i in range(6)]
    assert (first.rows, again.rows, again.rows_skipped) == (6, 0, 6)
