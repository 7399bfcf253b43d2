"""The job's input resolved once: `resolve_input` turns `--input` (a file, folder or glob;
local or a URI, see pipeline/io/storage.py) into an `InputSource`, the value every later step is
handed: its format, and each file's name as given, its path inside its filesystem (resolved
once for the whole input) and its size. Reading the columns, the strict check of every file,
the partition count and Ray Data's read take these and look no path up again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pipeline.config import InputConfig, InputFormat
from pipeline.io import storage

_SUFFIXES: dict[str, InputFormat] = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
}
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclass(frozen=True)
class InputFile:
    """One input file (or, for `hf`, the dataset's folder) as `resolve_input` found it."""

    name: str  # as the user would write it (a URI stays a URI): messages name it
    inner: str  # its path inside `filesystem` (a local file: the plain path)
    size: int  # bytes (a saved Hugging Face dataset: its folder's files)
    filesystem: Any = None  # pyarrow filesystem of a remote file; None: local

    def open(self) -> IO[bytes]:
        """The file open for reading bytes (a context manager)."""
        if self.filesystem is None:
            return open(self.inner, "rb")  # noqa: SIM115 (returned to a with block)
        opened: IO[bytes] = self.filesystem.open_input_file(self.inner)
        return opened


@dataclass(frozen=True)
class InputSource:
    """The resolved input: its format and the files (or, for `hf`, the folder) to read."""

    format: InputFormat
    files: tuple[InputFile, ...]

    @property
    def paths(self) -> tuple[str, ...]:
        """The files' names as given."""
        return tuple(f.name for f in self.files)

    @property
    def filesystem(self) -> Any:
        """The files' pyarrow filesystem (None: local), as Ray Data's `filesystem=` takes it."""
        return self.files[0].filesystem

    @property
    def num_bytes(self) -> int:
        return sum(f.size for f in self.files)


def resolve_input(config: InputConfig, exclude: str | None = None) -> InputSource:
    """Expand the path (file, folder or glob; local or a URI, see pipeline/io/storage.py) and
    settle the format; ValueError when nothing readable is there, or when the files are of
    several formats (the job reads one).

    Files inside the folder `exclude` (the job's --output) are no input: an output folder
    inside the input folder would otherwise be read back as input on every rerun."""
    path = config.path
    remote = storage.is_remote(path)
    if config.format == "hf" or (not remote and os.path.isdir(path) and _is_hf_folder(Path(path))):
        if remote or not os.path.isdir(path):
            raise ValueError(f"input {path!r}: a saved Hugging Face dataset must be a local folder")
        size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
        return InputSource("hf", (InputFile(path, path, size),))
    root = path  # where the files are listed from: their filesystem is resolved from it
    if any(ch in path for ch in "*?["):
        root = storage.glob_root(path)
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
    fs, inner, sizes = storage.located(root, files)
    return InputSource(
        fmt, tuple(InputFile(*found, fs) for found in zip(files, inner, sizes, strict=True))
    )


def _format_of(name: str) -> InputFormat | None:
    """The format a file's name says (`.gz` looked through), or None."""
    lowered = name.lower()
    if lowered.endswith(".gz"):
        lowered = lowered[:-3]
    return _SUFFIXES.get(os.path.splitext(lowered)[1])


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


def _is_hf_folder(folder: Path) -> bool:
    return any((folder / marker).exists() for marker in _HF_MARKERS)
