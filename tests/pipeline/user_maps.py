"""The users' own steps that the processor tests run in Ray Data tasks (a map before, a filter
and a fix after), in a module that imports only pyarrow. A task worker that unpickles a
function defined in a test module imports that module, and with it torch and transformers:
3.7 CPU-s per worker, two workers per such test (measured 2026-11-27 on the 2-core box)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

KEPT = "kept from the first run"


def with_query_len(row: dict) -> dict:
    """The user's own step before the processor: a column of their own."""
    return {**row, "query_len": len(row["query"])}


def no_error(row: dict) -> bool:
    """The user's own filter after the processor: the rows that ended well."""
    return row["error"] is None


def _mark_kept(batch: pa.Table) -> pa.Table:
    """The first run's text of the good rows marked, so a regenerated good row would show."""
    ok = pc.is_null(batch.column("error"))
    text = pc.if_else(ok, pa.scalar(KEPT), batch.column("generated_text"))
    return batch.set_column(batch.schema.get_field_index("generated_text"), "generated_text", text)


def fix_ids(fixes: dict[int, list[int]], seen: Path, batch: pa.Table) -> pa.Table:
    """The user's fix after the token-ids run: each error row's ids replaced (`fixes` by
    `k`), the other rows' text marked; each row's `k` appended to `seen`."""
    with seen.open("a") as f:
        f.write("".join(f"{k}\n" for k in batch.column("k").to_pylist()))
    batch = _mark_kept(batch)
    keys, ids = batch.column("k").to_pylist(), batch.column("ids").to_pylist()
    fixed = pa.array(
        [fixes.get(k, i) for k, i in zip(keys, ids, strict=True)], pa.list_(pa.int64())
    )
    return batch.set_column(batch.schema.get_field_index("ids"), "ids", fixed)


def fix_max_tokens(batch: pa.Table) -> pa.Table:
    """The user's fix: the out-of-range per-row max_tokens cleared; the good rows' text
    marked."""
    batch = _mark_kept(batch)
    cleared = pa.nulls(batch.num_rows, batch.schema.field("max_tokens").type)
    return batch.set_column(batch.schema.get_field_index("max_tokens"), "max_tokens", cleared)


def fix_samples(batch: pa.Table) -> pa.Table:
    """`fix_max_tokens`, and sample 1 of ok-1 given an error, as the engine gives one sample
    of a row (e.g. a sample that outgrows the KV cache) while the row's other samples end
    well."""
    batch = fix_max_tokens(batch)
    hit = pc.and_(pc.equal(batch.column("doc"), "ok-1"), pc.equal(batch.column("sample_index"), 1))
    error = pc.if_else(hit, pa.scalar("a sample's error"), batch.column("error"))
    return batch.set_column(batch.schema.get_field_index("error"), "error", error)
