"""How the README's test command (`pytest -n 2 -p tests.xdist_groups`) splits the suite over
two pytest-xdist workers: the offline job's tests (tests/pipeline, each starting or joining a
local Ray cluster, one after another) in one worker, everything else (the engine, packing and
benchmark tests, then the tensor/pipeline-parallel and Serve tests, which start their own Ray)
in the other, meanwhile. Measured on the 2-core box (2026-11-24): the pipeline tests are about
half of the suite's time and the rest the other half, where the earlier split (every Ray test
in one worker) left the second worker idle after two minutes of a fourteen-minute run. Each
worker's Ray is its own local cluster (its own temp dir and ports), so two can run at once.

A scheduler rather than `xdist_group` marks: pytest 9.2 builds a node id from `Node._id`, so
`--dist loadgroup` (xdist 3.8 rewrites `item._nodeid`) no longer groups anything.
"""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadScopeScheduling

# The test folder run in a worker of its own (the job's tests: a local cluster, or jobs that
# join one, one package-scoped cluster for the folder).
OWN_WORKER = ("pipeline",)
# Tests of that folder that use neither its cluster nor Ray in this process (the two-node
# job starts its own cluster in a subprocess): they run with the rest, which is done long
# before the job's tests are (2026-11-25: the two-node job was 110 s of ~1,060 s there;
# 2026-11-26: the job's worker summed 580 s, the other 554 s, so a refusal that runs in a
# subprocess of its own moved over too).
WITH_THE_REST = (
    "tests/pipeline/test_cluster.py::test_two_simulated_nodes_dp_and_pp_stages",
    "tests/pipeline/test_hostile_job.py::test_cli_exits_2_before_any_work",
)


class JobTestsApart(LoadScopeScheduling):
    """Two work units: the job's tests and the rest."""

    def _split_scope(self, nodeid: str) -> str:
        parts = nodeid.split("/")
        in_job_folder = len(parts) > 2 and parts[1] in OWN_WORKER
        return "job" if in_job_folder and not nodeid.startswith(WITH_THE_REST) else "rest"


def pytest_xdist_make_scheduler(config: Any, log: Any) -> JobTestsApart:
    """Use the two-unit split (only when xdist runs, `-n`)."""
    return JobTestsApart(config, log)
