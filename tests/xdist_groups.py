"""How the README's test command (`pytest -n 2 -p tests.xdist_groups`) splits the suite over
two pytest-xdist workers. The offline job's tests (tests/pipeline, one package-scoped local Ray
cluster) are most of the suite's time, so most of them run in one worker; the rest of the
suite (the engine, packing and benchmark tests, the tensor/pipeline-parallel tests, a few of
the job's heaviest modules, then the Serve tests) in the other, in collection order, so that
worker's Ray clusters still come one after another (parallel's, the job's, Serve's). Measured
on the 2-core box (2026-11-24): every Ray test in one worker ran 864 s of tests while the other
worker was done after about 100 s; tests/pipeline alone in one worker, 839 s.
Each worker's Ray is its own local cluster (its own temp dir and ports), so two run at once.

A scheduler rather than `xdist_group` marks: pytest 9.2 builds a node id from `Node._id`, so
`--dist loadgroup` (xdist 3.8 rewrites `item._nodeid`) no longer groups anything.
"""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadScopeScheduling

# The job's tests, in a worker of their own but for the modules in WITH_THE_REST (about a
# quarter of the folder's time, from one run's slowest-test durations).
JOB_FOLDER = "pipeline"
WITH_THE_REST = frozenset(
    {
        "test_s3.py",
        "test_parallel_job.py",
        "test_processor.py",
        "test_processor_retry.py",
        "test_restart_limit.py",
    }
)


class JobTestsApart(LoadScopeScheduling):
    """Two work units: the job's tests and the rest."""

    def _split_scope(self, nodeid: str) -> str:
        parts = nodeid.split("/")
        in_job = len(parts) > 2 and parts[1] == JOB_FOLDER
        return "job" if in_job and parts[2].split("::")[0] not in WITH_THE_REST else "rest"


def pytest_xdist_make_scheduler(config: Any, log: Any) -> JobTestsApart:
    """Use the two-unit split (only when xdist runs, `-n`)."""
    return JobTestsApart(config, log)
