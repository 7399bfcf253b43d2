"""The output folder is one job's alone: checked before any work, locked while a job runs,
and only the job's own files are ever deleted.

- `check_output` (before any inference, when the folder is claimed): the path is a folder, or
  can be made one, and a file can be written there.
- `OutputFolder.claim`: the lock file `_raypack.lock` names its holder (host, pid, start
  time); the holder touches it every `HEARTBEAT_S` seconds. A second job on the folder is
  refused (`OutputBusyError`) while the lock is fresh; a lock whose heartbeat is older than
  `STALE_S`, or whose pid is dead on this host (a killed driver), is taken over with a
  warning.
- The folder's job token, in `_raypack_job.json`, marks the data files: this job names them
  `raypack-<token>_...parquet` (`filename_prefix`), and resume reads or deletes only files
  with that prefix (pipeline/io/resume.py). Anything else in the folder is left alone.

The leading `_` keeps Parquet readers of the folder from taking these files for data.

The folder may be a URI (`s3://`, `gs://`: pipeline/io/storage.py). There the lock is NOT
atomic: object stores have no create-if-absent (O_EXCL) or rename through pyarrow.fs, so two
jobs started within the same second or so on one folder can both believe they hold it. The
lock still refuses a second job started while one runs (the usual mistake), and stale locks
are taken over the same way; a takeover race is not excluded.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from pipeline.io import storage

logger = logging.getLogger(__name__)

LOCK_FILE = "_raypack.lock"
STATE_FILE = "_raypack_job.json"
LINEAGE_FILE = "_lineage.json"  # what produced the folder: pipeline/io/lineage.py
DATA_PREFIX = "raypack-"
# `.<data file name>.tmp`: a data file still being written (pipeline/io/writer.py)
TMP_SUFFIX = ".tmp"
HEARTBEAT_S = 10.0
STALE_S = 60.0  # a lock not touched for this long belongs to a job that is gone


class OutputBusyError(ValueError):
    """Another job holds the output folder."""


def check_output(path: str, write: bool = True) -> None:
    """ValueError naming `--output` unless the folder exists (or is created here) and a file
    can be written in it: a file in its place or a read-only folder fails now, not after the
    inference. `write=False` (a dry run, which writes nothing) only refuses a file."""
    if storage.kind(path) == "file":
        raise ValueError(f"--output {path!r} is a file, not a folder")
    if not write:
        return
    try:
        storage.makedirs(path)
        probe = storage.join(path, f".raypack-write-check-{os.getpid()}")
        storage.write_bytes(probe, b"")
        storage.delete(probe)
    except OSError as exc:
        raise ValueError(f"--output {path!r} cannot be written: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class LockOwner:
    """Who holds an output folder."""

    host: str
    pid: int
    started: float  # time.time() when the job took the lock

    def describe(self) -> str:
        """The holder in words, for messages."""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"host {self.host}, pid {self.pid}, started {when}"


class OutputFolder:
    """A claimed output folder: holds the lock (with a heartbeat thread) until `release`."""

    def __init__(self, path: str, owner: LockOwner, token: str):
        self.path = path
        self.owner = owner
        self.token = token
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="raypack-lock", daemon=True)
        self._beat.start()

    @classmethod
    def claim(cls, path: str) -> OutputFolder:
        """Lock the folder for this process (creating it), or OutputBusyError naming the
        holder; a stale lock is taken over with a warning."""
        check_output(path)
        lock = storage.join(path, LOCK_FILE)
        owner = LockOwner(socket.gethostname(), os.getpid(), time.time())
        for _ in range(3):  # a takeover race with another job: look again
            if _create_lock(lock, owner):
                try:
                    token = _job_token(path)
                except ValueError:
                    storage.delete(lock)
                    raise
                return cls(path, owner, token)
            holder, age = _read_lock(lock)
            if holder is None and age is None:
                continue  # released between our two looks
            why = _stale(holder, age)
            if why is None:
                raise OutputBusyError(
                    f"--output {path!r} is in use by another job ("
                    f"{holder.describe() if holder else 'an unreadable lock'}; last heartbeat "
                    f"{age:.0f}s ago): wait for it to end or choose another folder. A lock "
                    f"whose job died is taken over {STALE_S:.0f}s after its last heartbeat "
                    f"({LOCK_FILE} in the folder)"
                )
            logger.warning(
                "--output %s: taking over the lock of a job that is gone (%s)", path, why
            )
            _break_lock(lock, holder)
        raise OutputBusyError(f"--output {path!r}: could not take the lock ({LOCK_FILE})")

    def filename_prefix(self) -> str:
        """What this job's data files are named with: `raypack-<token>`."""
        return f"{DATA_PREFIX}{self.token}"

    def is_ours(self, name: str) -> bool:
        """Whether a file name in the folder is one of this job's data files."""
        return name.startswith(self.filename_prefix() + "_") and name.endswith(".parquet")

    def release(self) -> None:
        """Stop the heartbeat and remove the lock (if it is still ours)."""
        self._stop.set()
        self._beat.join(timeout=5)
        lock = storage.join(self.path, LOCK_FILE)
        holder, _ = _read_lock(lock)
        if holder == self.owner:
            storage.delete(lock)

    def __enter__(self) -> OutputFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _heartbeat(self) -> None:
        lock = storage.join(self.path, LOCK_FILE)
        while not self._stop.wait(HEARTBEAT_S):
            holder, _ = _read_lock(lock)
            if holder != self.owner:
                logger.error(
                    "--output %s: another job took the lock (%s): this job no longer owns "
                    "the folder",
                    self.path,
                    holder.describe() if holder else "lock removed",
                )
                return
            try:
                _touch(lock, self.owner)
            except OSError as exc:
                logger.warning("--output %s: cannot touch the lock: %s", self.path, exc)


def _lock_text(owner: LockOwner) -> str:
    return json.dumps({"host": owner.host, "pid": owner.pid, "started": owner.started})


def _create_lock(lock: str, owner: LockOwner) -> bool:
    if storage.is_remote(lock):
        # NOT atomic (no O_EXCL on object stores): look, then write. See the module docstring.
        if storage.kind(lock) is not None:
            return False
        storage.write_bytes(lock, _lock_text(owner).encode())
        return True
    try:
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as fh:
        fh.write(_lock_text(owner))
    return True


def _touch(lock: str, owner: LockOwner) -> None:
    """The heartbeat: a fresh modification time (an object is rewritten to get one)."""
    if storage.is_remote(lock):
        storage.write_bytes(lock, _lock_text(owner).encode())
    else:
        os.utime(lock)


def _read_lock(lock: str) -> tuple[LockOwner | None, float | None]:
    """The lock's holder (None if unreadable) and its heartbeat age; (None, None) if no lock."""
    try:
        age = time.time() - storage.mtime(lock)
        data = json.loads(storage.read_bytes(lock))
        return LockOwner(str(data["host"]), int(data["pid"]), float(data["started"])), age
    except FileNotFoundError:
        return None, None
    except (ValueError, KeyError, TypeError, OSError):
        try:
            return None, time.time() - storage.mtime(lock)
        except OSError:
            return None, None


def _stale(holder: LockOwner | None, age: float | None) -> str | None:
    """Why the lock is stale, or None while its holder may be alive."""
    if age is not None and age > STALE_S:
        return f"last heartbeat {age:.0f}s ago"
    if holder is not None and holder.host == socket.gethostname() and not _alive(holder.pid):
        return f"{holder.describe()}: that process is gone"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _break_lock(lock: str, stale: LockOwner | None) -> None:
    if storage.is_remote(lock):
        # No rename on object stores: delete the lock if it is still the stale one (a look
        # then a delete, not atomic).
        if _read_lock(lock)[0] in (stale, None):
            storage.delete(lock)
        return
    # A rename is atomic: of two jobs taking over at once, one moves the lock, the other
    # finds nothing to move and looks again. If what was moved is no longer the stale lock
    # (the other job already made its own), it goes back.
    moved = Path(lock).with_name(f"{LOCK_FILE}.stale-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    try:
        os.rename(lock, moved)
    except FileNotFoundError:
        return
    if stale is not None and _read_lock(str(moved))[0] not in (stale, None):
        try:
            os.link(moved, lock)
        except OSError:
            pass
    moved.unlink(missing_ok=True)


def _job_token(folder: str) -> str:
    """The folder's job token (made on the first run and kept in STATE_FILE)."""
    state = storage.join(folder, STATE_FILE)
    if storage.kind(state) is not None:
        try:
            token = json.loads(storage.read_bytes(state))["job"]
            if isinstance(token, str) and token.isalnum():
                return token
        except (ValueError, KeyError, TypeError):
            pass
        raise ValueError(f"--output {folder!r}: {STATE_FILE} is not this program's state")
    token = uuid.uuid4().hex[:12]
    text = json.dumps({"job": token, "created": time.time()}) + "\n"
    if storage.is_remote(state):  # an object appears whole or not at all
        storage.write_bytes(state, text.encode())
        return token
    tmp = Path(folder) / f".{STATE_FILE}.{os.getpid()}"
    tmp.write_text(text)
    os.replace(tmp, state)
    return token
