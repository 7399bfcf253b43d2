"""Read the prompt table: find the files, check the columns before any work, build the dataset.

Everything up to `read_dataset` runs on the driver without Ray and touches at most one file's
header, so a bad path or a missing column fails in well under a second with a message that
names what exists.
"""

from __future__ import annotations

import csv
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from pipeline import storage
from pipeline.config import InputConfig, InputFormat
from pipeline.input_check import InputCheck, check_files, open_text

logger = logging.getLogger(__name__)

_SUFFIXES: dict[str, InputFormat] = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
}
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_PEEK_LINES = 100  # JSONL rows may differ in keys: the columns are the union of the first ones


@dataclass(frozen=True)
class InputSource:
    """The resolved input: its format and the files (or, for `hf`, the folder) to read."""

    format: InputFormat
    paths: tuple[str, ...]


def resolve_input(config: InputConfig, exclude: str | None = None) -> InputSource:
    """Expand the path (file, folder or glob; local or a URI, see pipeline/storage.py) and
    settle the format; ValueError when nothing readable is there, or when the files are of
    several formats (the job reads one).

    Files inside the folder `exclude` (the job's --output) are no input: an output folder
    inside the input folder would otherwise be read back as input on every rerun."""
    path = config.path
    remote = storage.is_remote(path)
    if config.format == "hf" or (not remote and os.path.isdir(path) and _is_hf_folder(Path(path))):
        if remote or not os.path.isdir(path):
            raise ValueError(f"input {path!r}: a saved Hugging Face dataset must be a local folder")
        return InputSource("hf", (path,))
    if any(ch in path for ch in "*?["):
        files = storage.glob(path)
        if not files:
            raise ValueError(f"input glob {path!r} matches no files")
    elif (found := storage.kind(path)) == "dir":
        files = [
            p
            for p in storage.list_files(path, recursive=True)
            if not storage.basename(p).startswith((".", "_")) and _format_of(p)
        ]
        if not files:
            raise ValueError(
                f"input folder {path!r} holds no .parquet, .jsonl/.json or .csv files "
                "(and is not a folder saved by datasets.save_to_disk)"
            )
    elif found == "file":
        files = [path]
    else:
        raise ValueError(f"input {path!r} does not exist")
    if exclude is not None:
        files = [f for f in files if not _inside(f, exclude)]
        if not files:
            raise ValueError(
                f"input {path!r}: every file is inside --output {exclude!r} (the job never "
                "reads its output as input)"
            )
    fmt = config.format or _format_of(files[0])
    if fmt is None:
        raise ValueError(
            f"cannot tell the format of {files[0]!r} from its name; "
            "pass the format (parquet, jsonl, csv or hf)"
        )
    _check_one_format(path, files, fmt)
    return InputSource(fmt, tuple(files))


def _check_one_format(path: str, files: list[str], fmt: str) -> None:
    """ValueError naming the files whose names say another format than `fmt` (files whose
    names say none are read as `fmt`)."""
    by_format: dict[str, list[str]] = {}
    for f in files:
        by_format.setdefault(_format_of(f) or fmt, []).append(storage.basename(f))
    if len(by_format) > 1:
        described = "; ".join(
            f"{len(names)} {name} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
            for name, names in by_format.items()
        )
        raise ValueError(
            f"input {path!r} mixes file formats: {described}. The job reads one format: "
            "point --input at one format's files (a glob such as 'folder/*.parquet')"
        )


def _inside(file: str, folder: str) -> bool:
    """Whether `file` is below `folder` (both local, or both URIs)."""
    if storage.is_remote(file) != storage.is_remote(folder):
        return False
    if storage.is_remote(file):
        return file.startswith(folder.rstrip("/") + "/")
    root = os.path.realpath(storage.local_path(folder))
    return os.path.realpath(storage.local_path(file)).startswith(root.rstrip(os.sep) + os.sep)


def input_columns(source: InputSource, hf_split: str | None = None) -> list[str]:
    """The column names of the input, read from one file's header (or the first JSONL rows);
    ValueError naming the file when it cannot be read."""
    first = source.paths[0]
    try:
        return _columns(source, hf_split)
    except UnicodeDecodeError as exc:
        raise ValueError(f"input {first}: not UTF-8 text ({exc})") from None
    except Exception as exc:  # pyarrow's ArrowInvalid / OSError on a cut or foreign file
        if isinstance(exc, ValueError | FileNotFoundError) and not isinstance(
            exc, pa.ArrowException
        ):
            raise  # ours, naming the file already
        raise ValueError(
            f"input {first}: not a readable {source.format} file ({type(exc).__name__}: {exc})"
        ) from None


def _columns(source: InputSource, hf_split: str | None) -> list[str]:
    first = source.paths[0]
    if source.format == "parquet":
        import pyarrow.parquet as pq

        fs, inner = storage.resolve(first)
        return list(pq.read_schema(inner, filesystem=fs).names)
    if source.format == "jsonl":
        keys: dict[str, None] = {}
        with open_text(first) as fh:
            for line_no, line in enumerate(fh):
                if line_no >= _PEEK_LINES:
                    break
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ValueError(
                            f"{first}: line {line_no + 1} is not JSON: {exc}"
                        ) from None
                    if not isinstance(row, dict):
                        raise ValueError(f"{first}: line {line_no + 1} is not a JSON object")
                    keys.update(dict.fromkeys(row))
        return list(keys)
    if source.format == "csv":
        with open_text(first) as fh:
            header = next(csv.reader(fh), [])
        return list(header)
    return list(_load_hf(first, hf_split).column_names)


def check_columns(available: list[str], needed: dict[str, str], path: str) -> None:
    """ValueError when a needed column is missing; `needed` maps column -> why it is needed."""
    missing = {c: why for c, why in needed.items() if c not in available}
    if missing:
        described = "; ".join(f"{c!r} ({why})" for c, why in missing.items())
        raise ValueError(f"input {path!r} has no column {described}. Its columns: {available}")


def check_input(source: InputSource) -> InputCheck:
    """Read every input file once, strictly (`input_check.check_files`: each file's problems
    named with the file, and the line for text formats); a saved Hugging Face dataset is
    checked by `datasets` when loaded."""
    if source.format == "hf":
        return InputCheck()
    return check_files(source.format, source.paths)


def read_dataset(
    source: InputSource,
    hf_split: str | None,
    num_cpus: float,
    rows_per_block: int,
    checked: InputCheck | None = None,
):  # noqa: ANN201 (ray.data.Dataset)
    """The input as a Ray dataset, cut into blocks of at most `rows_per_block` rows (small
    Parquet inputs otherwise arrive as one block and only one tokenizer would work)."""
    import ray.data

    paths = list(source.paths)
    fs = storage.filesystem(paths[0]) if source.format != "hf" else None
    # The paths are already resolved and the format decided (--input-format overrides the file
    # names): Ray Data must not drop files whose extension does not match the format.
    if source.format == "parquet":
        # Ray Data's V1 Parquet reader: V2 (Ray 2.60's default) starts 32 FooterReader actors
        # for every read, which cost 5 s per job on an idle 2-core machine (7-13 s under load)
        # against 0.1 s for V1, whatever the input's size. The flag is read when the read is
        # built; the user's own setting is restored right after.
        context = ray.data.DataContext.get_current()
        use_v2, context.use_datasource_v2 = context.use_datasource_v2, False
        try:
            ds = ray.data.read_parquet(
                paths, num_cpus=num_cpus, file_extensions=None, filesystem=fs
            )
        finally:
            context.use_datasource_v2 = use_v2
    elif source.format == "jsonl":
        ds = ray.data.read_json(
            paths, lines=True, num_cpus=num_cpus, file_extensions=None, filesystem=fs
        )
    elif source.format == "csv":
        import pyarrow.csv

        # pyarrow splits CSV into blocks at newlines unless told values may hold them.
        multiline = checked is None or checked.csv_multiline_values
        parse = pyarrow.csv.ParseOptions(newlines_in_values=multiline)
        ds = ray.data.read_csv(
            paths, num_cpus=num_cpus, parse_options=parse, file_extensions=None, filesystem=fs
        )
    else:
        ds = ray.data.from_huggingface(_load_hf(paths[0], hf_split))
    return ds.repartition(target_num_rows_per_block=rows_per_block)


def _format_of(name: str) -> InputFormat | None:
    lowered = name.lower()
    if lowered.endswith(".gz"):
        lowered = lowered[:-3]
    return _SUFFIXES.get(os.path.splitext(lowered)[1])


def _is_hf_folder(folder: Path) -> bool:
    return any((folder / marker).exists() for marker in _HF_MARKERS)


def _load_hf(path: str, split: str | None):  # noqa: ANN202 (datasets.Dataset)
    import datasets

    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if split is None:
            if len(splits) != 1:
                raise ValueError(f"input {path!r} has splits {splits}: name one (hf_split)")
            split = splits[0]
        if split not in loaded:
            raise ValueError(f"input {path!r} has no split {split!r}; its splits: {splits}")
        return loaded[split]
    if split is not None:
        logger.warning("input %s is a single dataset; hf_split %r ignored", path, split)
    return loaded
