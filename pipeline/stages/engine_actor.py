"""The engine actors' share of the cluster, for the job and the processor alike: resources and
restart policy, torch threads, and how many shards one actor holds at once."""

from __future__ import annotations

import math
import os
from typing import Any

from actors.config import EngineConfig
from pipeline.cluster_cpus import available_cpus, largest_node_cpus, threads_per_actor
from pipeline.config import ComputeConfig, PlanConfig

MAX_SHARDS_IN_FLIGHT = 16  # per engine actor: each is a thread waiting in the actor

# A CPU engine actor starts at the driver's priority (Ray's `RAY_worker_niceness`, which Ray's
# own job manager sets to 0 for a job's driver), so that its imports and load, the job's start-up
# critical path, come before the tokenizer's and Ray Data's other processes (nice 15) on a small
# node; once loaded it steps at `STEP_NICENESS` (`lower_priority`), Ray's default for workers:
# the steps at nice 0 were measured slower (docs/benchmarks-job-engine.md).
STEP_NICENESS_ENV = "RAYPACK_STEP_NICENESS"
STEP_NICENESS = 15  # Ray's default `worker_niceness`


def shards_in_flight(engine: EngineConfig, plan: PlanConfig) -> int:
    """Shards one engine actor holds at once: twice `max_num_seqs` in rows, plus one shard.

    A shard keeps its place until its last row ends (pipeline/stages/feed.py), and by then most of
    its rows have long finished: with only `max_num_seqs` rows in flight the engine ran out
    of waiting prompts mid-job (1,024 Alpaca rows, 64-row shards: 160 of 281 steps with none
    waiting, a median of 192 running of 256; docs/benchmarks-job-engine.md). Twice that keeps
    prompts waiting until the last shard is in."""
    rows = plan.max_rows_per_shard
    return min(MAX_SHARDS_IN_FLIGHT, max(2, math.ceil(2 * engine.max_num_seqs / rows) + 1))


def engine_actor_args(compute: ComputeConfig, placements: Any = None) -> dict:
    """Resources and restart policy of an engine actor: a GPU each when the cluster has GPUs
    (or as configured), else a fraction of a CPU; plus any custom resources and memory.

    With `placements` (pipeline.job.engine_placement.EnginePlacements, for tp x pp engines) each
    actor is created in a placement group of its own and takes no GPU itself: its workers
    hold them, one per bundle.

    The actor's process preloads `compute.allocator` (actors/allocator.py: tcmalloc where
    the machine has it) through its `runtime_env`; a tp x pp engine's workers inherit it. A
    CPU engine actor (no GPU, no placement group) starts at nice 0 and steps at
    `STEP_NICENESS` (`lower_priority`, called by the stage once its engine is loaded)."""
    import ray

    from actors.allocator import preload_env

    gpus = compute.num_gpus_per_actor
    if gpus is None:
        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    args: dict = dict(
        num_cpus=compute.num_cpus_per_actor,
        num_gpus=gpus,
        max_restarts=compute.max_restarts,
        max_task_retries=compute.max_restarts,
    )
    if compute.resources:
        args["resources"] = dict(compute.resources)
    if compute.memory_gb_per_actor:
        args["memory"] = int(compute.memory_gb_per_actor * 2**30)
    env = preload_env(compute.allocator)
    if not gpus and placements is None:  # a CPU engine: its start-up first (STEP_NICENESS_ENV)
        env = {**env, "RAY_worker_niceness": "0", STEP_NICENESS_ENV: str(STEP_NICENESS)}
    if env:
        args["runtime_env"] = {"env_vars": env}
    if placements is not None:
        args["num_gpus"] = 0
        args["ray_remote_args_fn"] = placements
    return args


def default_torch_threads(
    compute: ComputeConfig, actor_args: dict, world_size: int = 1
) -> int | None:
    """Torch threads of a CPU engine actor: the cluster's CPUs shared by the engine actors,
    at most its largest node's (`pipeline.cluster_cpus.threads_per_actor`).

    Ray sets OMP_NUM_THREADS to an actor's whole CPUs, so a 0.5-CPU actor would run torch
    on one thread however many cores are idle; the CPU fraction is only for scheduling.
    None (torch's default) for GPU actors and for tp x pp engines (their workers compute).
    """
    if actor_args["num_gpus"] or world_size > 1:
        return None
    return threads_per_actor(available_cpus(), largest_node_cpus(), compute.num_actors)


def lower_priority() -> int | None:
    """In an engine actor started by `engine_actor_args` at the driver's priority: every thread
    of this process (the torch threads the engine's load started too) to `STEP_NICENESS`, as
    Ray runs its workers. Raising one's own niceness needs no privilege. The niceness set, or
    None when this process was not started so (or not on Linux)."""
    target = os.environ.get(STEP_NICENESS_ENV)
    if target is None:
        return None
    niceness = int(target)
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no /proc (not Linux): the actor keeps its priority
        return None
    for tid in threads:  # Linux keeps a niceness per thread
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except OSError:  # the thread ended meanwhile
            continue
    return niceness
