"""A command's own local Ray, shut down beside the job's tail (issue 28 item 4).

`ray.shutdown()` of a local Ray takes ~1.5 s on a 2-core machine, most of it waiting for its
processes (GCS, raylet, dashboard) to exit after SIGTERM. The job's summary and `_report.png`
(0.4-0.7 s, matplotlib) need no Ray, so the command starts the shutdown in a thread as soon as
`run_job` is done with Ray (its `ray_done`) and joins it after the report, so most of the
report comes off the tail (0.2-0.3 s of its 0.4 s on a 2-core box: the shutdown itself is a
little slower beside it; docs/benchmarks.md, Start-up).
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)


class RayShutdown:
    """`start()` shuts the connected Ray down in a thread; `wait()` joins it and returns the
    shutdown's own seconds (None if it never started)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._seconds: float | None = None

    def start(self) -> None:
        """Begin the shutdown (once; later calls do nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="raypack-ray-shutdown")
            self._thread.start()

    def wait(self) -> float | None:
        """Wait for the shutdown to end; its seconds, or None if `start` was never called."""
        if self._thread is None:
            return None
        self._thread.join()
        return self._seconds

    def _run(self) -> None:
        import ray

        started = time.perf_counter()
        try:
            ray.shutdown()
        except Exception:  # noqa: BLE001 (the job is done; Ray's exit hook tries again)
            logger.warning("Ray's shutdown failed", exc_info=True)
        self._seconds = round(time.perf_counter() - started, 2)
