"""Rows that share an id: identical ones are generated once, different ones are never
silently dropped.

The id stage gives every row a content hash (`CONTENT`: of the whole input row) beside its
id and registers both with the job's `StatsCollector` (`register_rows`) before the shuffle.
The shuffle is a barrier (no partition is planned before every row has been read), so when
the planner runs, the collector knows every version of every id. Then, per partition:

- copies of one version (same id, same content) share a dedupe key and are generated once
  (the first partition to claim the key plans it, see `StatsCollector.claim_ids`);
- an id with two or more versions (different content) is, with `on_duplicate="error"` (the
  default), one error row per version naming the others; with `"first"`, the version
  registered first is generated and the others dropped with a warning and counted.

The others are named by a preview of the row (its JSON, cut at 120 characters) when one was
taken: the id stage sends previews of its rows whose id already has another version, so a
version read before any other is named by its content hash only (keeping a preview of
every row in the collector would double its memory).

With `--no-prefix-grouping` there is no shuffle and so no barrier: a version planned before
another version of its id was read is generated, and only the later ones become error rows
(still none is dropped silently).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from pipeline.stages import stage

logger = logging.getLogger(__name__)

CONTENT = "_raypack_content"  # hash of the input row, from the id stage to the planner
DEDUPE_KEY = "_raypack_dedupe_key"  # what identical rows share: the id, or id + content
ON_DUPLICATE = ("error", "first")
PREVIEW_CHARS = 120

# id -> its versions in registration order: (content hash, a preview of the row or None)
Versions = Mapping[str, Sequence[tuple[str, str | None]]]


def preview(row: Mapping[str, Any]) -> str:
    """A short text of an input row, to name it in another row's error."""
    text = json.dumps(row, default=str, ensure_ascii=False)
    return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 3] + "..."


def resolve(batch: pa.Table, versions: Versions, on_duplicate: str) -> tuple[pa.Table, int]:
    """One partition with a `DEDUPE_KEY` column; the rows of an id with several versions
    (known to the collector, `versions`, or seen in this partition) marked as errors or, for
    `"first"`, dropped unless they are the first version. Also how many rows were dropped.

    A batch without `CONTENT` (no id stage before it) is keyed by id alone."""
    ids = batch.column(stage.ID).to_pylist()
    if CONTENT not in batch.column_names:
        return batch.append_column(DEDUPE_KEY, pa.array(ids, pa.string())), 0
    hashes = batch.column(CONTENT).to_pylist()
    known: dict[str, list[tuple[str, str | None]]] = {i: list(v) for i, v in versions.items()}
    for row_id, h in zip(ids, hashes, strict=True):  # versions only this partition has seen
        seen = known.setdefault(row_id, [])
        if h not in (v[0] for v in seen):
            seen.append((h, None))
    conflicting = {i for i, v in known.items() if len(v) > 1}
    keys = [f"{i}\0{h}" if i in conflicting else i for i, h in zip(ids, hashes, strict=True)]
    batch = batch.append_column(DEDUPE_KEY, pa.array(keys, pa.string()))
    if not conflicting:
        return batch, 0
    if on_duplicate == "first":
        keep = [
            i not in conflicting or h == known[i][0][0] for i, h in zip(ids, hashes, strict=True)
        ]
        dropped = len(keep) - sum(keep)
        if dropped:
            names = sorted({i for i, k in zip(ids, keep, strict=True) if not k})
            logger.warning(
                "%d rows share an id with a different row read first and are not generated "
                "(--on-duplicate first): ids %s",
                dropped,
                names[:10],
            )
        return batch.filter(pa.array(keep, pa.bool_())), dropped
    errors = batch.column(stage.ERROR).to_pylist()
    for r, (row_id, h) in enumerate(zip(ids, hashes, strict=True)):
        if row_id in conflicting:
            errors[r] = _message(row_id, h, known[row_id])
    column = batch.schema.get_field_index(stage.ERROR)
    return batch.set_column(column, stage.ERROR, pa.array(errors, pa.string())), 0


def _message(row_id: str, content: str, versions: Sequence[tuple[str, str | None]]) -> str:
    others = [p or f"a row read earlier (content hash {h})" for h, p in versions if h != content]
    return (
        f"id {row_id!r} is used by {len(versions)} input rows with different content, so "
        f"none of them is generated (ids must name one row each: fix the input, or pass "
        f"--on-duplicate first to generate the first one read); the other: "
        + "; ".join(others[:3])
        + (f"; and {len(others) - 3} more" if len(others) > 3 else "")
    )
