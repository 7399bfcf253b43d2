"""Resume: the output folder itself is the checkpoint.

Before a run, every complete Parquet file this job wrote in the output folder (named with the
folder's job token, see pipeline/io/output.py) is read for its `id` column; those ids are dropped
right after the id stage, so a rerun generates only what is missing. One of its files cut
short by a killed run (no Parquet footer) is deleted first: its rows were never complete, so
they are simply generated again. Files the job did not write are never read or deleted.

Why not Ray Data's own checkpointing (`ray.data.checkpoint.CheckpointConfig`, wired in through
`DataContext.checkpoint_config`)? We read its 2.60 source: it filters rows right after the
`Read` operator and writes a second copy of the ids (a pending file before each data file, a
rename after), which gives the same no-duplicate guarantee but
- needs the id column to exist in the source files: our default id is a hash of the row
  computed after the read, and Hugging Face datasets come in through `from_huggingface`, which
  is not a `Read` op, so checkpointing is silently disabled there (a warning only);
- adds an actor pool of filter actors, each reserving 1 GiB of memory, on top of the
  tokenizer and engine pools (the 2-CPU machines this runs on already need care to not
  deadlock);
- deletes its checkpoint on success by default, after which a rerun would write everything
  again into the same folder.
The output files are already the ground truth of what is done; keeping a second record means
keeping two records in agreement. Each Parquet file appears whole or not at all to a reader
(the footer is written last), and a retried write task rewrites the same file name (Ray names
files by write id and task index), so reading the ids back is exact. Tests kill the driver
midway and check that the rerun leaves every id exactly once.

With `retry_errors` (`--retry-errors`) the rows whose stored `error` is set are not done: each
of this job's files holding such rows is rewritten without them before the run (a temporary
file renamed over it; on an object store the object is replaced whole), or deleted when only
they are left, and the run generates them again into new files. A row is never in two files:
its error row is gone before its new row is written. A run killed in between leaves those rows
in no file, i.e. not done, and any rerun generates them (as after any kill).

A row with several samples (`sample_index`, pipeline/stages/infer.py) has all of them in one file
(a shard is written whole), so its id is done exactly when its samples are there; with
`retry_errors` a sample with an error takes its row's other samples out with it, so the
rerun's samples never meet old ones.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.io import storage
from pipeline.io.done_ids import DoneIds, done_filter  # noqa: F401 (the job's resume filter)
from pipeline.io.output import LINEAGE_FILE, LOCK_FILE, STATE_FILE, TMP_SUFFIX
from pipeline.io.report import REPORT_FILE, SUMMARY_FILE
from pipeline.stages import stage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutputState:
    """What an output folder already holds."""

    files: tuple[str, ...]  # this job's complete Parquet files
    removed: tuple[str, ...]  # this job's files cut short (or left open) by a killed run, deleted
    foreign: tuple[str, ...] = ()  # files this job did not write, left alone
    retried: int = 0  # error rows dropped to be generated again (retry_errors)
    num_done: int = 0  # rows in `files` (from their footers)

    @property
    def done_ids(self) -> frozenset[str]:
        """Every id in `files`, read now (for small folders and tests; the job itself
        filters through `done_filter`, which keeps no id on the driver)."""
        import pyarrow.parquet as pq

        done: set[str] = set()
        for path in self.files:
            fs, inner = storage.resolve(path)
            table = pq.read_table(inner, columns=[stage.ID], filesystem=fs)
            done.update(table.column(stage.ID).to_pylist())
        return frozenset(done)


def data_files(output: str | Path, prefix: str | None = None) -> list[str]:
    """The Parquet data files in an output folder, local or a URI (reports and hidden files
    excluded); with `prefix`, only those named `<prefix>_...` (one job's, see
    pipeline/io/output.py)."""
    return [
        p
        for p in storage.list_files(output)
        if (name := storage.basename(p)).endswith(".parquet")
        and not name.startswith((".", "_"))
        and (prefix is None or name.startswith(prefix + "_"))
    ]


def scan_output(output: str | Path, prefix: str, retry_errors: bool = False) -> OutputState:
    """Read the ids in this job's files (named `<prefix>_...parquet`); delete those of its
    files a killed run left incomplete. Every other file is left alone and named in a
    warning: only what the job wrote is ever read back or deleted. With `retry_errors`, its
    rows with an error are dropped from its files and are not done (module docstring)."""
    import pyarrow.parquet as pq

    if storage.kind(output) == "file":
        raise ValueError(f"--output {str(output)!r} is a file, not a folder")
    files: list[str] = []
    removed = _remove_open_files(output, prefix)
    num_done = 0
    retried = 0
    fs = storage.filesystem(output)
    for path in data_files(output, prefix):
        try:
            parquet = pq.ParquetFile(storage.resolve(path)[1], filesystem=fs)
        except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a cut file
            logger.warning("removing %s, left incomplete by an earlier run (%s)", path, exc)
            storage.delete(path)
            removed.append(path)
            continue
        if stage.ID not in parquet.schema_arrow.names:
            raise ValueError(
                f"--output {str(output)!r}: {storage.basename(path)} is named as this job's but has no "
                f"{stage.ID!r} column; the folder's state is damaged: choose another folder"
            )
        if retry_errors and stage.ERROR in parquet.schema_arrow.names:
            dropped = _drop_error_rows(path, parquet)
            retried += dropped
            if dropped and storage.kind(path) is None:  # nothing but error rows: deleted
                continue
            if dropped:
                parquet = pq.ParquetFile(storage.resolve(path)[1], filesystem=fs)
        num_done += parquet.metadata.num_rows
        files.append(path)
    foreign = _foreign(output, prefix)
    if foreign:
        shown = ", ".join(foreign[:10]) + (
            f" and {len(foreign) - 10} more" if len(foreign) > 10 else ""
        )
        logger.warning(
            "--output %s holds %d files this job did not write, left alone (readers of the "
            "folder will see them too): %s",
            output,
            len(foreign),
            shown,
        )
    if retried:
        logger.info("--retry-errors: %d error rows of %s are generated again", retried, output)
    if files:
        logger.info("resuming: %d rows already in %d files of %s", num_done, len(files), output)
    return OutputState(tuple(files), tuple(removed), tuple(foreign), retried, num_done)


def _remove_open_files(output: str | Path, prefix: str) -> list[str]:
    """Delete the job's files a killed run left open (pipeline/io/writer.py: `.<name>.tmp`, local
    folders only; on object stores an unclosed file never appears)."""
    removed = []
    for name in storage.names(output):
        if name.startswith(f".{prefix}_") and name.endswith(TMP_SUFFIX):
            path = storage.join(output, name)
            logger.warning("removing %s, left open by an earlier run", path)
            storage.delete(path)
            removed.append(path)
    return removed


def _drop_error_rows(path: str, parquet) -> int:  # noqa: ANN001 (pyarrow.parquet.ParquetFile)
    """Rewrite one of the job's files without its error rows and the other samples of their
    ids (a whole-file replacement), or delete it when nothing else is left; how many rows
    were dropped."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    errors = parquet.read(columns=[stage.ERROR]).column(stage.ERROR)
    dropped = errors.length() - errors.null_count
    if dropped == 0:
        return 0
    table = parquet.read()
    failed = table.filter(pc.is_valid(table.column(stage.ERROR))).column(stage.ID).unique()
    kept = table.filter(pc.invert(pc.is_in(table.column(stage.ID), value_set=failed)))
    dropped = table.num_rows - kept.num_rows
    if kept.num_rows == 0:
        storage.delete(path)
        return dropped
    fs, inner = storage.resolve(path)
    if fs is not None:  # an object store replaces an object whole or not at all
        pq.write_table(kept, inner, filesystem=fs)
        return dropped
    tmp = Path(inner).with_name(f".{Path(inner).name}.retry-{os.getpid()}")
    pq.write_table(kept, tmp)
    os.replace(tmp, inner)  # atomic: a reader sees the old file or the new one
    return dropped


def _foreign(output: str | Path, prefix: str) -> list[str]:
    own = {LOCK_FILE, STATE_FILE, LINEAGE_FILE, SUMMARY_FILE, REPORT_FILE}
    return sorted(
        name
        for name in storage.names(output)
        if not name.startswith(".")
        and name not in own
        and not name.startswith(LOCK_FILE + ".stale-")
        and not (name.startswith(prefix + "_") and name.endswith(".parquet"))
    )
