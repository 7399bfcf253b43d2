"""Output files sized for big jobs: writer actors gather many shards' rows into Parquet files
of at most `max_rows_per_file` rows and about `max_bytes_per_file` bytes (FilesConfig).

    infer (one block per shard) -> write tasks (ShardSink.write_shards) -> FileWriter actors

A write task sends each shard's rows to one `FileWriter` (chosen by a stable hash of the shard
id, so a retried task reaches the same writer). A writer keeps one file open, appends whole
shards to it (buffered into row groups of up to `ROW_GROUP_ROWS` rows), and closes it before
a shard would take it past `max_rows_per_file` (a shard larger than that gets a file of its
own) or once its size reaches `max_bytes_per_file`; the driver closes the last ones when the
write is over (`ShardSink.close`).

A file becomes visible under its name only when it is closed, complete:
- local: written as `.<name>.tmp` (hidden: resume and readers skip it), renamed into place
  (`os.replace`, atomic);
- object stores (`s3://`, `gs://`): written through an output stream, which makes the object
  appear when it is closed (the upload completes) and not before; a stream a dying process
  leaves is never completed. Should one ever be completed without its Parquet footer, resume
  deletes it as a cut file (pipeline/io/resume.py).
Rows appended to a file that was never closed (driver killed, writer died) are in no visible
file, so they are not done and a rerun generates them again; a temp file left behind is
deleted by the next run. A writer remembers the shard ids it took in this run (about 60 bytes
per shard) and ignores a shard that comes again (a retried write task), so no row is written
twice within a run; across runs the id stage drops ids already written (pipeline/io/resume.py).

A writer that dies fails the run (its open file is lost; the next run generates its rows).
Import this module only where Ray is wanted.
"""

from __future__ import annotations

import logging
import os
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pipeline.config import FilesConfig
from pipeline.io import storage
from pipeline.io.output import TMP_SUFFIX
from pipeline.stages import stage

logger = logging.getLogger(__name__)

ROW_GROUP_ROWS = 65536  # rows buffered in a writer before they go to the file as a row group
ROW_GROUP_BYTES = 32 * 2**20  # ... or this many bytes (Arrow, uncompressed)
WRITTEN_ROWS = "rows"  # a write task's one row: how many rows the writers took
WRITTEN_SCHEMA = pa.schema([(WRITTEN_ROWS, pa.int64())])
# A write task only waits on the writer actors. With a CPU share (0.25) it queued behind the
# engine and tokenizer actors on a small node, the engine's finished shards piled up before
# it and the driver's RSS grew with rows (docs/benchmarks-job.md, "The job at scale").
WRITE_TASK_CPUS = 0.0001
# ... so Ray Data would start a write task (a worker process) for every finished block at
# once: 24-33 Ray workers instead of 19 in a 2-core test job, which ran 1.5x as long. A
# writer takes one append at a time, so more tasks than this per writer only wait.
WRITE_TASKS_PER_WRITER = 2


# Engines per writer when `FilesConfig.num_writers` is not given. A writer appends whole
# shards, which any engine makes at a few rows a second, and is a process of its own (0.45
# CPU-s to start, ~0.5 % of a core idle) with a file of its own open to the end: one per engine
# actor gave a 2-core CPU node's two engines two writers (and two files for 525 rows), and
# a 64-core node's 64 one-thread engines 64.
ENGINES_PER_WRITER = 8


def default_num_writers(num_engines: int) -> int:
    """Writers for a job of `num_engines` (over all its engine actors) when the user did not
    say: one per `ENGINES_PER_WRITER` engines, at least one."""
    return max(1, -(-num_engines // ENGINES_PER_WRITER))


def writer_of(shard_id: str, num_writers: int) -> int:
    """The writer a shard goes to (stable across processes, unlike `hash`)."""
    return zlib.crc32(shard_id.encode()) % num_writers


@dataclass
class _OpenFile:
    """One file being written: its sink, Parquet writer, buffered tables and counts."""

    final: str  # the name it gets when closed (a URI or a local path)
    tmp: str | None  # the local temp path (None on an object store)
    sink: Any  # pyarrow NativeFile
    writer: Any  # pyarrow.parquet.ParquetWriter
    schema: pa.Schema
    rows: int = 0
    buffered: list[pa.Table] | None = None
    buffered_rows: int = 0
    buffered_bytes: int = 0

    @classmethod
    def open(cls, final: str, schema: pa.Schema) -> _OpenFile:
        import pyarrow.parquet as pq

        fs, inner = storage.resolve(final)
        if fs is None:
            tmp = os.path.join(os.path.dirname(inner), f".{os.path.basename(inner)}{TMP_SUFFIX}")
            sink = pa.OSFile(tmp, "wb")
        else:
            tmp = None
            sink = fs.open_output_stream(inner, compression=None)
        return cls(final, tmp, sink, pq.ParquetWriter(sink, schema), schema, buffered=[])

    @property
    def size(self) -> int:
        """Bytes so far: written, plus the buffered rows at their Arrow size (an upper bound
        of what they take in the file)."""
        return int(self.sink.tell()) + self.buffered_bytes

    def add(self, table: pa.Table) -> None:
        assert self.buffered is not None
        self.buffered.append(table)
        self.rows += table.num_rows
        self.buffered_rows += table.num_rows
        self.buffered_bytes += table.nbytes
        if self.buffered_rows >= ROW_GROUP_ROWS or self.buffered_bytes >= ROW_GROUP_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.buffered:
            return
        table = pa.concat_tables(self.buffered)
        self.writer.write_table(table, row_group_size=max(1, table.num_rows))
        self.buffered, self.buffered_rows, self.buffered_bytes = [], 0, 0

    def commit(self) -> None:
        """Write the footer, close, and make the file visible under its name."""
        self.flush()
        self.writer.close()
        self.sink.close()
        if self.tmp is not None:
            os.replace(self.tmp, storage.local_path(self.final))


class FileWriter:
    """A Ray actor (`ray.remote(FileWriter)`, no restarts) writing shards into sized files.

    Files are named `<prefix>_<run>-<index>-<n>.parquet`: the folder's job token
    (pipeline/io/output.py), this run, this writer, a counter."""

    def __init__(self, folder: str, prefix: str, run: str, index: int, files: FilesConfig):
        self.folder = folder
        self.name_start = f"{prefix}_{run}-{index}"
        self.files = files
        self._seen: set[str] = set()  # shard ids taken in this run
        self._open: _OpenFile | None = None
        self._count = 0
        self._committed: list[tuple[str, int]] = []

    def append(self, shard_ids: Sequence[str], table: pa.Table) -> int:
        """Add the rows of `shard_ids` (`table`, a shard column naming them) to the open file;
        shards already taken in this run are ignored. How many rows were added."""
        import pyarrow.compute as pc

        added = 0
        column = table.column(stage.SHARD)
        for shard_id in dict.fromkeys(shard_ids):
            if shard_id in self._seen:
                logger.info("shard %s came again (a retried write): ignored", shard_id)
                continue
            rows = table.filter(pc.equal(column, shard_id))
            self._add_shard(rows)
            self._seen.add(shard_id)
            added += rows.num_rows
        return added

    def _add_shard(self, rows: pa.Table) -> None:
        if rows.num_rows == 0:
            return
        current = self._open
        if current is not None:
            if current.rows + rows.num_rows > self.files.max_rows_per_file:
                self._commit()  # the shard goes whole into the next file
            else:
                try:
                    rows = rows.cast(current.schema) if rows.schema != current.schema else rows
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError):
                    self._commit()  # a type the open file cannot take (e.g. was all null)
        if self._open is None:
            self._count += 1
            name = f"{self.name_start}-{self._count:05d}.parquet"
            self._open = _OpenFile.open(storage.join(self.folder, name), rows.schema)
        self._open.add(rows)
        if (
            self._open.rows >= self.files.max_rows_per_file
            or self._open.size >= self.files.max_bytes_per_file
        ):
            self._commit()

    def _commit(self) -> None:
        if self._open is None:
            return
        opened, self._open = self._open, None
        opened.commit()
        self._committed.append((opened.final, opened.rows))
        logger.info("wrote %s (%d rows)", opened.final, opened.rows)

    def close(self) -> list[tuple[str, int]]:
        """Close the open file; every file this writer made visible, with its rows."""
        self._commit()
        return list(self._committed)


class ShardSink:
    """The job's side of the writers: `sink.write(ds)` sends every block's shards to their
    writers (a map task per block, `write_shards`) and streams the tasks' row counts back;
    when the write is over, the writers close their last files (`committed` then lists every
    file written, with its rows) and are ended.

    Not `ds.write_datasink`: that materializes the write's output, so the driver holds a ref
    to every write task's result (and Ray the lineage behind it) until the write ends. Here
    each result is dropped as it arrives. Measured (docs/benchmarks-job.md): this was not
    what makes the driver grow with rows (about 215 bytes per row, native, still there)."""

    def __init__(self, folder: str, prefix: str, files: FilesConfig, num_writers: int):
        import ray

        run = uuid.uuid4().hex[:8]
        remote = ray.remote(num_cpus=0, max_restarts=0)(FileWriter)
        self.writers = [
            remote.remote(folder, prefix, run, i, files) for i in range(max(1, num_writers))
        ]
        self.committed: list[tuple[str, int]] = []
        self.rows = 0
        self.max_tasks = WRITE_TASKS_PER_WRITER * len(self.writers)  # write tasks at once

    def write(self, ds: Any, num_cpus: float = WRITE_TASK_CPUS) -> Any:
        """Write `ds` (blocks with a shard column) and close the files; the written Dataset
        (executed: its stats are there). At most `WRITE_TASKS_PER_WRITER` write tasks per
        writer run at once. On an error the writers are ended (a file they left open stays
        invisible) and the error raised."""
        import ray.data

        written = ds.map_batches(
            self.write_shards,
            batch_format="pyarrow",
            batch_size=None,
            num_cpus=num_cpus,
            compute=ray.data.TaskPoolStrategy(size=self.max_tasks),
        )
        try:
            for counts in written.iter_batches(batch_size=None, batch_format="pyarrow"):
                self.rows += sum(counts.column(WRITTEN_ROWS).to_pylist())
            self.close()
        except BaseException:
            self.end()
            raise
        return written

    def write_shards(self, table: pa.Table) -> pa.Table:
        """A write task: the block's shards to their writers; one row, the rows they took."""
        import ray

        return pa.table({WRITTEN_ROWS: [sum(ray.get(self.send(table)))]}, WRITTEN_SCHEMA)

    def send(self, table: pa.Table) -> list[Any]:
        """Each writer's part of `table` (whole shards) to it; the refs of their answers."""
        import pyarrow.compute as pc

        calls: list[Any] = []
        if table.num_rows == 0:
            return calls
        by_writer: dict[int, list[str]] = {}
        for shard_id in table.column(stage.SHARD).unique().to_pylist():
            by_writer.setdefault(writer_of(shard_id, len(self.writers)), []).append(shard_id)
        for index, shard_ids in by_writer.items():
            if len(by_writer) > 1:  # each writer gets only its shards' rows
                mine = pc.is_in(table.column(stage.SHARD), value_set=pa.array(shard_ids))
                part = table.filter(mine)
            else:
                part = table
            calls.append(self.writers[index].append.remote(shard_ids, part))
        return calls

    def close(self) -> None:
        """Close every writer's open file (`committed` gets every file written) and end
        the writers."""
        import ray

        try:
            for files in ray.get([w.close.remote() for w in self.writers]):
                self.committed.extend(files)
        finally:
            self.end()

    def end(self) -> None:
        """End the writer actors (a file they left open stays invisible)."""
        import ray

        for writer in self.writers:
            ray.kill(writer)
