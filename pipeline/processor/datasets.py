"""Ray Data helpers of the processor's path that hold no processor state: the schema check
before anything runs, a row's first sample, and a dataset on a context of its own without
per-operator reservations (the job's dataset too)."""

from __future__ import annotations

from pipeline.processor.stages import IntakeStage
from pipeline.stages import stage


def first_row_per_key(batch, key: str):  # noqa: ANN001, ANN201 (pyarrow.Table in and out)
    """A batch holding every row of its keys -> its first row per `key` by sample index:
    a row's samples -> the row, once."""
    import pyarrow as pa

    order = batch.sort_by([(key, "ascending"), (stage.SAMPLE_INDEX, "ascending")])
    keys = order.column(key).to_pylist()
    first = [i for i, k in enumerate(keys) if i == 0 or k != keys[i - 1]]
    return order.take(pa.array(first, pa.int64()))


def without_reservations(ds):  # noqa: ANN001, ANN202 (ray.data.Dataset in and out)
    """`ds` on a DataContext of its own, without Ray Data's per-operator resource reservations.

    With them, the shuffle's second partition waited for the engines: its reduce task's CPU
    budget was what the engine actors left, so it ran only once an engine had finished a
    shard (the job: ~40 s idle on 1,024 rows; the processor on 525 rows with two engines:
    one engine's first shard at 65 s; docs/benchmarks-job-engine.md). A context is shared by
    every dataset from the same read (for the processor, the user's), so the dataset gets a
    copy (`Dataset.copy(..., _deep_copy=True)`: Ray Data has no public way to give a dataset
    a context of its own) and the other datasets keep theirs. The job and the processor both
    run their datasets through this."""
    from ray.data import Dataset

    ds = Dataset.copy(ds, _deep_copy=True)
    ds.context.op_resource_reservation_enabled = False
    return ds


def check_schema(ds, needed: dict[str, str], outputs: tuple[str, ...]) -> None:  # noqa: ANN001
    """The intake's checks now, when the schema is known without running anything."""
    try:
        schema = ds.schema(fetch_if_missing=False)
    except Exception:  # noqa: BLE001 (no cheap schema: the intake checks the first batch)
        return
    if schema is None:
        return
    IntakeStage(needed, outputs, ()).check(list(schema.names))
