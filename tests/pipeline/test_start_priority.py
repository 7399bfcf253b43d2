"""A CPU engine actor starts at the driver's priority and steps at Ray's worker niceness
(pipeline/stages/engine_actor.py): its imports and load, the job's start-up critical path,
come before the other workers'; its steps run as Ray runs workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import ComputeConfig
from pipeline.stages.engine_actor import (
    STEP_NICENESS,
    STEP_NICENESS_ENV,
    engine_actor_args,
    lower_priority,
)

ROOT = Path(__file__).resolve().parents[2]

# Run in a child: lowering the priority of the test process's own threads would stay.
_CHILD = """
import os, sys, threading
sys.path.insert(0, sys.argv[1])
from pipeline.stages.engine_actor import lower_priority
stop = threading.Event()
helper = threading.Thread(target=stop.wait)
helper.start()  # a thread started before, as the engine's torch threads are
print(lower_priority())
print(*(os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")))
stop.set()
"""


def _child(env: dict[str, str]) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(ROOT)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout.split("\n")


def _env(args: dict) -> dict[str, str]:
    return args.get("runtime_env", {}).get("env_vars", {})


def test_only_a_cpu_engine_actor_starts_at_the_drivers_priority() -> None:
    cpu = _env(engine_actor_args(ComputeConfig(num_gpus_per_actor=0, allocator="system")))
    assert cpu == {"RAY_worker_niceness": "0", STEP_NICENESS_ENV: str(STEP_NICENESS)}
    gpu = _env(engine_actor_args(ComputeConfig(num_gpus_per_actor=1, allocator="system")))
    assert gpu == {}
    # a tp x pp engine's workers inherit the actor's runtime_env and never lower theirs
    placed = engine_actor_args(
        ComputeConfig(num_gpus_per_actor=0, allocator="system"), placements=object()
    )
    assert _env(placed) == {}


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="Linux only")
def test_lower_priority_lowers_every_thread_only_when_started_for_it() -> None:
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    lowered, priorities = _child({STEP_NICENESS_ENV: "15"})[:2]
    assert lowered == "15"
    assert [int(p) for p in priorities.split()] == [max(mine, 15)] * len(priorities.split())
    assert len(priorities.split()) >= 2  # the main thread, the helper (and any library's)
    env = {k: v for k, v in os.environ.items() if k != STEP_NICENESS_ENV}
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(ROOT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    untouched, priorities = result.stdout.split("\n")[:2]
    assert untouched == "None"
    assert {int(p) for p in priorities.split()} == {mine}
    assert lower_priority() is None  # this process was not started for it


@pytest.mark.timeout(120)
def test_ray_starts_the_engine_actor_at_the_drivers_priority(ray_cluster) -> None:  # noqa: ANN001
    import ray

    class Probe:
        def niceness(self) -> int:
            return os.getpriority(os.PRIO_PROCESS, 0)

        def lowered(self) -> tuple[int | None, set[int]]:
            done = lower_priority()
            tasks = os.listdir("/proc/self/task")
            return done, {os.getpriority(os.PRIO_PROCESS, int(t)) for t in tasks}

    compute = ComputeConfig(num_cpus_per_actor=0.1, num_gpus_per_actor=0, allocator="system")
    probe = ray.remote(**engine_actor_args(compute))(Probe).remote()
    try:
        driver = os.getpriority(os.PRIO_PROCESS, 0)
        assert ray.get(probe.niceness.remote()) == driver  # not Ray's 15 for workers
        assert ray.get(probe.lowered.remote()) == (STEP_NICENESS, {max(driver, STEP_NICENESS)})
    finally:
        ray.kill(probe)
