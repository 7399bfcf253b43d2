"""The command's own Ray goes down last, after a full collection (pipeline/commands/shutdown.py):
a Ray reference held only by garbage is freed while Ray is still up, never in the shutdown's
window, where freeing it `_Exit(1)`s the driver. In a fresh Python with its own Ray, the
collector off (as if no collection had run since the job made the garbage)."""

from __future__ import annotations

import pytest

from tests.fresh_python import run_python

SCRIPT = """
import gc, weakref
import ray
from pipeline.commands.shutdown import shutdown_ray

gc.disable()
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)

class Garbage:
    pass

garbage = Garbage()
garbage.cycle = garbage  # only the collector frees it
garbage.ref = ray.put(1)
freed_with_ray_up = []
weakref.finalize(garbage, lambda: freed_with_ray_up.append(ray.is_initialized()))
del garbage
seconds = shutdown_ray()
assert freed_with_ray_up == [True], freed_with_ray_up
assert not ray.is_initialized() and seconds > 0
"""


@pytest.mark.timeout(120)
def test_garbage_holding_a_ray_reference_is_freed_before_the_shutdown() -> None:
    run_python(SCRIPT, timeout=100)
