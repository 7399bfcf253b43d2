"""The strict check of every input file before any work (`check_files`), and how the job opens a
text input (`open_text`).

Each file is read once, whole, on the driver, and refused (ValueError naming the file, and the
line for text formats) where Ray Data's readers would otherwise misread it or fail inside the
job with a traceback:

- CSV: an unterminated quote (pyarrow takes the rest of the file into that value without a
  word), a line with more or fewer values than the header;
- JSONL: a line that is not a JSON object; a column (or a field inside one, at any depth)
  holding two JSON types (a text in one line and an object in another: pyarrow's reader
  refuses the file, `Column(/prompt) changed from string to object`), across files too;
- Parquet: a file without a readable footer (cut, or not Parquet), or with a data page that
  does not decode (every row group is read: the footer alone says nothing of the pages);
- any text file: UTF-16 or UTF-32 (a byte order mark says so: save it as UTF-8), or bytes that
  are not UTF-8. A UTF-8 byte order mark is skipped, as pyarrow's readers do.

Text formats cost one pass of Python's parsers (tens of MB/s), Parquet one pyarrow read a row
group at a time: small beside generating for the same rows.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pipeline.io.input_source import InputFile

_WIDE_BOMS = (  # longest first: UTF-32 LE starts with UTF-16 LE's mark
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)


@dataclass(frozen=True)
class InputCheck:
    """What `check_files` learnt that the read needs."""

    csv_multiline_values: bool = False  # a quoted CSV value holds a newline
    # Rows the files hold (Parquet footers, JSONL's non-blank lines, CSV's records after the
    # header); None when not counted (a saved Hugging Face dataset). Only a hint: a rerun
    # looks for rows left to do when the output holds at least this many (pipeline/job/run.py).
    num_rows: int | None = None


def check_files(fmt: str, files: tuple[InputFile, ...]) -> InputCheck:
    """Read every input file once and fail (ValueError naming the file, and the line for text
    formats) on what a reader would otherwise misread or fail on inside the job."""
    multiline = False
    kinds = _JsonKinds()
    num_rows = 0
    for file in files:
        if fmt == "parquet":
            num_rows += _check_parquet(file)
        elif fmt == "jsonl":
            num_rows += _check_jsonl(file, kinds)
        elif fmt == "csv":
            file_multiline, file_rows = _check_csv(file)
            multiline |= file_multiline
            num_rows += file_rows
    return InputCheck(csv_multiline_values=multiline, num_rows=num_rows)


@contextmanager
def open_text(file: InputFile) -> Iterator[io.TextIOBase]:
    """A text input as UTF-8 text (a leading UTF-8 byte order mark skipped, `.gz` inflated);
    ValueError naming the file when it is UTF-16 or UTF-32."""
    path = file.name
    with _open_bytes(file) as raw:
        head = raw.read(4)
    for bom, encoding in _WIDE_BOMS:
        if head.startswith(bom):
            raise ValueError(
                f"input {path}: {encoding} text (it starts with a {encoding} byte order mark); "
                "the job reads UTF-8: save the file as UTF-8"
            )
    with _open_bytes(file) as raw:
        yield io.TextIOWrapper(raw, encoding="utf-8-sig", newline="")


@contextmanager
def _open_bytes(file: InputFile) -> Iterator[Any]:
    with file.open() as raw:
        if file.name.endswith(".gz"):
            with gzip.GzipFile(fileobj=raw) as inflated:
                yield inflated
        else:
            yield raw


def _check_parquet(file: InputFile) -> int:
    """Check one Parquet file; its rows."""
    import pyarrow.parquet as pq

    path = file.name
    try:
        parquet = pq.ParquetFile(
            file.inner, filesystem=file.filesystem, page_checksum_verification=True
        )
    except Exception as exc:  # ArrowInvalid / OSError, by pyarrow version
        raise ValueError(f"input {path}: not a readable Parquet file ({exc})") from None
    for group in range(parquet.num_row_groups):
        try:
            parquet.read_row_group(group)  # decodes every page: a corrupt one raises
        except Exception as exc:  # OSError (decompression, page header), ArrowInvalid
            raise ValueError(
                f"input {path}: row group {group} of {parquet.num_row_groups} cannot be read, "
                f"the file is damaged ({type(exc).__name__}: {exc})"
            ) from None
    return int(parquet.metadata.num_rows)


def _check_jsonl(file: InputFile, kinds: _JsonKinds) -> int:
    """Check one JSONL file; its rows (non-blank lines)."""
    path = file.name
    rows = 0
    with open_text(file) as fh:
        try:
            for line_no, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"input {path}: line {line_no} is not JSON: {exc}") from None
                if not isinstance(row, dict):
                    raise ValueError(
                        f"input {path}: line {line_no} is not a JSON object "
                        f"(got {type(row).__name__})"
                    )
                kinds.add(row, path, line_no)
                rows += 1
        except UnicodeDecodeError as exc:
            raise ValueError(f"input {path}: not UTF-8 text ({exc})") from None
    return rows


@dataclass
class _JsonKinds:
    """The JSON type of every column and nested field seen so far (path -> kind and where it
    was first seen), as pyarrow's JSON reader types them: null goes with anything, an integer
    with a float (both numbers); any other pair of types in one field is refused."""

    seen: dict[str, tuple[str, str, int]] = field(default_factory=dict)

    def add(self, row: dict[str, Any], path: str, line_no: int) -> None:
        """Record `row`'s types; ValueError naming both places when one clashes."""
        for key, value in row.items():
            self._value(key, f"/{key}", value, path, line_no)

    def _value(self, column: str, where: str, value: Any, path: str, line_no: int) -> None:
        if value is None:
            return
        kind = _kind(value)
        first = self.seen.setdefault(where, (kind, path, line_no))
        if first[0] != kind:
            inside = "" if where == f"/{column}" else f" (at {where})"
            raise ValueError(
                f"input {path}: line {line_no}: column {column!r}{inside} holds {_A[kind]}, but "
                f"{_A[first[0]]} on line {first[2]} of {first[1]}: a column must hold one JSON "
                "type in every row (make them all text, e.g. JSON-encode the objects)"
            )
        if kind == "object":
            for key, item in value.items():
                self._value(column, f"{where}/{key}", item, path, line_no)
        elif kind == "array":
            for item in value:
                self._value(column, f"{where}/[]", item, path, line_no)


_A = {
    "string": "a string",
    "number": "a number",
    "boolean": "a boolean",
    "object": "an object",
    "array": "an array",
}


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    return "array"


def _check_csv(file: InputFile) -> tuple[bool, int]:
    """Strictly parse one CSV file; whether some quoted value spans lines, and its records
    after the header."""
    path = file.name
    multiline = False
    records = 0
    with open_text(file) as fh:
        reader = csv.reader(fh, strict=True)
        start = 1  # the line the next record starts on
        width = None
        try:
            for record in reader:
                if width is None:
                    width = len(record)
                elif record and len(record) != width:
                    raise ValueError(
                        f"input {path}: line {start} has {len(record)} values, "
                        f"the header has {width}"
                    )
                multiline |= reader.line_num > start
                records += bool(record)
                start = reader.line_num + 1
        except csv.Error as exc:
            if reader.line_num > start:  # the record ran on to the end: a quote never closed
                raise ValueError(
                    f"input {path}: line {start}: a quoted value opened there is never closed "
                    f"(the CSV parser read to line {reader.line_num}: {exc})"
                ) from None
            raise ValueError(f"input {path}: line {start} is not valid CSV: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"input {path}: not UTF-8 text ({exc})") from None
    return multiline, max(0, records - 1)
