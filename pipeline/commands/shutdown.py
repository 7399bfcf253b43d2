"""A command's own Ray, shut down once nothing else runs: after the job's summary and report.

Why not beside them (as the command did until 2026-11-28, in a thread, to take ~0.3 s off
the tail): Ray's `ObjectRef.__dealloc__` calls `worker.core_worker.remove_object_ref_reference`,
and while `ray.shutdown()` is in `core_worker.shutdown_driver()` the C++ core worker is gone
but `worker.core_worker` is not yet deleted. A reference freed on another thread in that
window (the executed datasets' cyclic garbage, collected whenever the report's allocations
trigger a collection) makes Ray log "The core worker has already been shutdown ... The
process will exit" and `_Exit(1)` the driver: twice in `bench_job.py`'s 525-row jobs on
2026-11-28, their rows all written, their summaries never printed (in the second, stacks
dumped every 20 ms showed a collection running while the shutdown thread was in
`shutdown_driver()`). Once the shutdown is over, `worker.core_worker` is gone and a freed
reference is ignored, so the references still alive then are safe.

So the shutdown runs on the main thread, last, after a full collection: the cyclic garbage
that holds references goes while Ray is still up, and a collection during the shutdown
finds none.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def shutdown_ray() -> float:
    """Collect the garbage (freeing its Ray references while Ray is up), then shut the
    connected Ray down; the shutdown's seconds (the collection's included)."""
    import ray

    started = time.perf_counter()
    gc.collect()
    try:
        ray.shutdown()
    except Exception:  # noqa: BLE001 (the job is done; Ray's exit hook tries again)
        logger.warning("Ray's shutdown failed", exc_info=True)
    return round(time.perf_counter() - started, 2)
