"""How the README's test command (`pytest -n 2 -p tests.xdist_groups`) splits the suite over
two pytest-xdist workers: every test that starts Ray in one worker, one after another as
without xdist (each package's cluster fixture starts and stops once), everything else in the
other, meanwhile. On 2 cores the Ray tests spend much of their time waiting on process
start-up and Ray's own loops, which the CPU-bound engine and packing tests fill.

A scheduler rather than `xdist_group` marks: pytest 9.2 builds a node id from `Node._id`, so
`--dist loadgroup` (xdist 3.8 rewrites `item._nodeid`) no longer groups anything.
"""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadScopeScheduling

# Test folders whose tests start Ray (a local cluster, Serve, or a job that joins one).
RAY_FOLDERS = ("pipeline", "serve", "parallel")


class RayTestsApart(LoadScopeScheduling):
    """Two work units: the Ray tests and the rest."""

    def _split_scope(self, nodeid: str) -> str:
        parts = nodeid.split("/")
        return "ray" if len(parts) > 2 and parts[1] in RAY_FOLDERS else "local"


def pytest_xdist_make_scheduler(config: Any, log: Any) -> RayTestsApart:
    """Use the two-unit split (only when xdist runs, `-n`)."""
    return RayTestsApart(config, log)
