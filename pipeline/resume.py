"""Resume: the output folder itself is the checkpoint.

Before a run, every complete Parquet file in the output folder is read for its `id` column;
those ids are dropped right after the id stage, so a rerun generates only what is missing.
A file cut short by a killed run (no Parquet footer) is deleted first: its rows were never
complete, so they are simply generated again.

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
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline import stage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutputState:
    """What an output folder already holds."""

    files: tuple[str, ...]  # complete Parquet files
    done_ids: frozenset[str]
    removed: tuple[str, ...]  # partial files of a killed run, deleted


def data_files(output: str | Path) -> list[Path]:
    """The Parquet data files in an output folder (reports and hidden files excluded)."""
    folder = Path(output)
    if not folder.is_dir():
        return []
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and p.suffix == ".parquet" and not p.name.startswith((".", "_"))
    )


def scan_output(output: str | Path) -> OutputState:
    """Read the ids already written; delete files a killed run left incomplete."""
    import pyarrow.parquet as pq

    if Path(output).exists() and not Path(output).is_dir():
        raise ValueError(f"output {str(output)!r} exists and is not a folder")
    files: list[str] = []
    removed: list[str] = []
    done: set[str] = set()
    for path in data_files(output):
        try:
            parquet = pq.ParquetFile(path)
        except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a cut file
            logger.warning("removing %s, left incomplete by an earlier run (%s)", path, exc)
            os.remove(path)
            removed.append(str(path))
            continue
        if stage.ID not in parquet.schema_arrow.names:
            raise ValueError(
                f"output folder {str(output)!r} holds {path.name} without an {stage.ID!r} column: "
                "it is not this job's output; choose another folder"
            )
        done.update(parquet.read(columns=[stage.ID]).column(stage.ID).to_pylist())
        files.append(str(path))
    if files:
        logger.info("resuming: %d rows already in %d files of %s", len(done), len(files), output)
    return OutputState(tuple(files), frozenset(done), tuple(removed))
