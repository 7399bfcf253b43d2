"""A model folder (or .gguf file) in cloud storage, copied once per machine to a local cache.

`--model s3://bucket/models/x` (or `gs://`, anything `pyarrow.fs.FileSystem.from_uri`
resolves; credentials and endpoint from the environment, e.g. `AWS_ENDPOINT_URL`) is copied
to `<cache>/remote-models/<name>-<key>`, where the key hashes the URI and every file's path,
size and modification time: a changed model is a new copy, an unchanged one is never fetched
again. Each process that needs the model (the driver, each engine and tokenizer actor) calls
this; the copy is written to a temporary folder and renamed into place, so processes starting
at once on one node never see half a model (the losers of the race discard their copy).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_CHUNK = 16 * 2**20


def is_uri(model: str) -> bool:
    """Whether `model` names cloud storage (a URI other than `file://`)."""
    return bool(_SCHEME.match(model)) and not model.lower().startswith("file://")


def fetch(uri: str, cache: Path) -> tuple[Path, str | None]:
    """The local folder holding the model at `uri` (copied on first use), and the GGUF file's
    name in it when `uri` is a .gguf file. FileNotFoundError when nothing is there."""
    from pyarrow import fs as pafs

    filesystem, inner = pafs.FileSystem.from_uri(uri)
    inner = inner.rstrip("/")
    top = filesystem.get_file_info(inner)
    if top.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"model {uri!r}: nothing there")
    gguf = None
    if top.type == pafs.FileType.File:
        files = [top]
        gguf = top.base_name if top.base_name.endswith(".gguf") else None
        if gguf is None:
            raise FileNotFoundError(f"model {uri!r} is a file but not a .gguf file")
    else:
        selector = pafs.FileSelector(inner, recursive=True)
        files = [f for f in filesystem.get_file_info(selector) if f.type == pafs.FileType.File]
    key = hashlib.sha256(uri.encode())
    for f in sorted(files, key=lambda f: str(f.path)):
        key.update(f"\0{f.path}\0{f.size}\0{f.mtime_ns}".encode())
    name = (top.base_name or "model").removesuffix(".gguf")
    target = cache / "remote-models" / f"{name}-{key.hexdigest()[:16]}"
    if not target.is_dir():
        _copy(filesystem, inner, files, target, uri)
    return target, gguf


def _copy(filesystem: Any, inner: str, files: list[Any], target: Path, uri: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    logger.info("copying model %s to %s (once per machine)", uri, target)
    try:
        for f in files:
            relative = str(f.path)[len(inner) :].lstrip("/") or f.base_name
            dest = staging / relative
            dest.parent.mkdir(parents=True, exist_ok=True)
            with (
                filesystem.open_input_stream(f.path, compression=None) as src,
                dest.open("wb") as out,
            ):
                shutil.copyfileobj(src, out, _CHUNK)
        try:
            os.rename(staging, target)
        except OSError:  # another process won the race; its copy is complete
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
