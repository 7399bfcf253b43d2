"""Paths that are local or in cloud storage: one place that tells them apart.

A path with a scheme (`s3://bucket/key`, `gs://bucket/key`, anything
`pyarrow.fs.FileSystem.from_uri` resolves) goes through `pyarrow.fs`; credentials, region and
endpoint come from the usual environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_SESSION_TOKEN`, `AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL`: pyarrow's `from_uri` reads
them; Google's default credentials for `gs://`). A path without a scheme (or `file://`) is
local and keeps the plain `os` / `pathlib` calls: `resolve` gives no filesystem for it, so
pyarrow and Ray Data readers and writers see exactly the arguments they always did.

Ray workers build their own client from the pickled filesystem: the endpoint travels with it,
the credentials do not (pyarrow keeps only explicit keys): workers need them in their own
environment (instance roles, or the job's `runtime_env` `env_vars`).

A filesystem is made per call (about 2 ms), never kept in a module-level cache.
"""

from __future__ import annotations

import glob as globlib
import os
import re
from pathlib import Path
from typing import IO, Any

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_GLOB_CHARS = "*?["


def is_remote(path: str | Path) -> bool:
    """Whether `path` is a URI other than `file://` (read through pyarrow.fs)."""
    text = str(path)
    return bool(_SCHEME.match(text)) and not text.lower().startswith("file://")


def local_path(path: str | Path) -> str:
    """A local path as a plain path (`file://` stripped); remote paths unchanged."""
    text = str(path)
    return text[len("file://") :] if text.lower().startswith("file://") else text


def resolve(path: str | Path) -> tuple[Any, str]:
    """(pyarrow filesystem, path inside it) for a remote path; (None, the local path) for a
    local one, which is what pyarrow's and Ray Data's `filesystem=` arguments take as "local,
    as before"."""
    if not is_remote(path):
        return None, local_path(path)
    from pyarrow import fs as pafs

    filesystem, inner = pafs.FileSystem.from_uri(str(path))
    return filesystem, inner


def filesystem(path: str | Path) -> Any:
    """The pyarrow filesystem for Ray Data's `filesystem=` (None for a local path)."""
    return resolve(path)[0]


def join(folder: str | Path, name: str) -> str:
    """`folder/name` (a URI stays a URI)."""
    if is_remote(folder):
        return str(folder).rstrip("/") + "/" + name
    return os.path.join(local_path(folder), name)


def basename(path: str | Path) -> str:
    """The last part of a path or URI."""
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def kind(path: str | Path) -> str | None:
    """ "file", "dir" or None (nothing there)."""
    fs, inner = resolve(path)
    if fs is None:
        return "dir" if os.path.isdir(inner) else "file" if os.path.isfile(inner) else None
    from pyarrow import fs as pafs

    found = fs.get_file_info(inner).type
    if found == pafs.FileType.Directory:
        return "dir"
    return None if found == pafs.FileType.NotFound else "file"


def list_files(folder: str | Path, recursive: bool = False) -> list[str]:
    """The files in a folder (below it too when `recursive`), sorted, as paths of the same
    kind as `folder`; [] when there is no such folder."""
    fs, inner = resolve(folder)
    if fs is None:
        root = Path(inner)
        if not root.is_dir():
            return []
        found = root.rglob("*") if recursive else root.iterdir()
        return sorted(str(p) for p in found if p.is_file())
    from pyarrow import fs as pafs

    selector = pafs.FileSelector(inner, allow_not_found=True, recursive=recursive)
    infos = fs.get_file_info(selector)
    # `folder` may be written with or without its scheme's trailing parts: rebuild each URI
    # from the folder as given and the part of the key below it.
    base = str(folder).rstrip("/")
    below = inner.rstrip("/")
    return sorted(
        base + info.path[len(below) :] for info in infos if info.type == pafs.FileType.File
    )


def names(folder: str | Path) -> list[str]:
    """The names in a folder, files and subfolders ([] when there is no such folder)."""
    fs, inner = resolve(folder)
    if fs is None:
        root = Path(inner)
        return [p.name for p in root.iterdir()] if root.is_dir() else []
    from pyarrow import fs as pafs

    infos = fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    return [basename(info.path) for info in infos]


def glob(pattern: str) -> list[str]:
    """The files a glob matches (`**` spans folders), sorted."""
    if not is_remote(pattern):
        local = local_path(pattern)
        return sorted(p for p in globlib.glob(local, recursive=True) if os.path.isfile(p))
    regex = re.compile(_glob_regex(pattern))
    return [p for p in list_files(glob_root(pattern), recursive=True) if regex.fullmatch(p)]


def glob_root(pattern: str) -> str:
    """The folder a remote glob's matches are listed from: its parts before the first
    wildcard (a local pattern as it is: only that it is local matters to `located`)."""
    if not is_remote(pattern):
        return local_path(pattern)
    scheme, _, rest = pattern.partition("://")
    parts = rest.split("/")
    fixed = next(i for i, part in enumerate(parts) if any(c in part for c in _GLOB_CHARS))
    return f"{scheme}://" + "/".join(parts[:fixed])


def located(root: str, paths: list[str]) -> tuple[Any, list[str], list[int]]:
    """(filesystem, each path inside it, each file's size) for files at or below `root`,
    named as `list_files` and `glob` name them: the filesystem is resolved once, from `root`,
    and the sizes asked for in one call."""
    fs, below = resolve(root)
    if fs is None:
        inner = [local_path(p) for p in paths]
        return None, inner, [os.path.getsize(p) for p in inner]
    base = str(root).rstrip("/")
    inner = [below.rstrip("/") + p[len(base) :] if p != root else below for p in paths]
    return fs, inner, [int(info.size) for info in fs.get_file_info(inner)]


def _glob_regex(pattern: str) -> str:
    """A glob as a regex: `*`, `?` and `[...]` stay inside one folder, `**` spans folders."""
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        char = pattern[i]
        close = pattern.find("]", i + 2) if char == "[" else -1
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif close != -1:
            body = pattern[i + 1 : close].replace("\\", "\\\\")
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = close + 1
            continue
        else:
            out.append(re.escape(char))
        i += 1
    return "".join(out)


def size(path: str | Path) -> int:
    """A file's size in bytes."""
    fs, inner = resolve(path)
    if fs is None:
        return os.path.getsize(inner)
    return int(fs.get_file_info(inner).size)


def mtime(path: str | Path) -> float:
    """A file's modification time (seconds since the epoch); FileNotFoundError if missing."""
    fs, inner = resolve(path)
    if fs is None:
        return os.stat(inner).st_mtime
    info = fs.get_file_info(inner)
    if info.mtime is None:
        raise FileNotFoundError(str(path))
    return float(info.mtime.timestamp())


def open_input(path: str | Path) -> IO[bytes]:
    """A file open for reading bytes (a context manager)."""
    fs, inner = resolve(path)
    if fs is None:
        return open(inner, "rb")  # noqa: SIM115 (returned to a with block)
    opened: IO[bytes] = fs.open_input_file(inner)
    return opened


def read_bytes(path: str | Path) -> bytes:
    """A whole file; FileNotFoundError if missing."""
    with open_input(path) as fh:
        return fh.read()


def write_bytes(path: str | Path, data: bytes) -> None:
    """Write a whole file. On object stores the object appears whole or not at all."""
    fs, inner = resolve(path)
    if fs is None:
        Path(inner).write_bytes(data)
        return
    with fs.open_output_stream(inner, compression=None) as fh:  # bytes as given, even .gz
        fh.write(data)


def delete(path: str | Path) -> None:
    """Delete a file; nothing if it is already gone."""
    fs, inner = resolve(path)
    if fs is None:
        Path(inner).unlink(missing_ok=True)
        return
    try:
        fs.delete_file(inner)
    except FileNotFoundError:
        pass


def makedirs(path: str | Path) -> None:
    """Create a folder and its parents (on object stores: nothing to create but the bucket
    must exist)."""
    fs, inner = resolve(path)
    if fs is None:
        Path(inner).mkdir(parents=True, exist_ok=True)
        return
    fs.create_dir(inner, recursive=True)
