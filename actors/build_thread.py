"""The thread an engine was built in, and a warning when another thread steps it.

torch's CPU threads are GNU OpenMP's (the pip wheels), which keeps a pool of threads per
thread that starts parallel regions. An engine built in one thread (loading the model runs
parallel regions) and stepped in another leaves two pools in the process; when their threads
outnumber the cores, libgomp's idle threads sleep instead of spinning, and each of a step's
many small parallel ops waits for a wake-up. Measured on 2 cores (`benchmarks/omp_pools.py`):
small element-wise ops 9.3x slower, a whole job's engine steps ~15 % slower. raypack's own
paths build the engine in the thread that steps it (pipeline/stages/feed.py, Serve's
`staging.step_thread`); a user's program that does not is told once, with the remedy.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class BuildThread:
    """Made where the engine is built; `check()` at every step (a thread id compare)."""

    def __init__(self) -> None:
        import torch  # here, not at the top: `usable_cores` serves torch-free callers too

        self.ident = threading.get_ident()
        self.name = threading.current_thread().name
        self.torch_threads = torch.get_num_threads()
        self.checked = False

    def pools_contend(self, stepping_threads: int) -> bool:
        """Two OpenMP pools (this thread's and the stepping one's) would outnumber the cores."""
        return (
            self.torch_threads > 1
            and stepping_threads > 1
            and self.torch_threads + stepping_threads > usable_cores()
        )

    def check(self) -> None:
        """On the first step from another thread, warn if the two pools contend."""
        if self.checked or threading.get_ident() == self.ident:
            return
        self.checked = True
        import torch

        here = torch.get_num_threads()
        if self.pools_contend(here):
            logger.warning(
                "this LLMEngine was built in thread %r with %d torch threads and is stepped in "
                "thread %r with %d, on %d cores: two OpenMP thread pools then make every step "
                "slower (~15%% measured on 2 cores). Build the engine in the thread that steps "
                "it, or call torch.set_num_threads(1) in the building thread before building.",
                self.name,
                self.torch_threads,
                threading.current_thread().name,
                here,
                usable_cores(),
            )
