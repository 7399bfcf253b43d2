"""The engine actors' share of the cluster, for the job and the processor alike: resources and
restart policy, torch threads, and how many shards one actor holds at once."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from actors.config import EngineConfig
from pipeline.cluster_cpus import available_cpus, largest_node_cpus, threads_per_actor
from pipeline.config import ComputeConfig, PlanConfig

MAX_SHARDS_IN_FLIGHT = 16  # per engine actor: each is a thread waiting in the actor


def shards_in_flight(
    engine: EngineConfig, plan: PlanConfig, rows_per_actor: int | None = None
) -> int:
    """Shards one engine actor holds at once: twice `max_num_seqs` in rows, plus one shard.

    A shard keeps its place until its last row ends (pipeline/stages/feed.py), and by then most of
    its rows have long finished: with only `max_num_seqs` rows in flight the engine ran out
    of waiting prompts mid-job (1,024 Alpaca rows, 64-row shards: 160 of 281 steps with none
    waiting, a median of 192 running of 256; docs/benchmarks-job-engine.md). Twice that keeps
    prompts waiting until the last shard is in.

    With `rows_per_actor` (the rows over the engine actors, when the caller knows them) at
    most that share: Ray Data hands shards to the actors up now, so the first engine up took
    9 of a 1,024-row job's 16 shards and the other engine idled at the end (2 engines of 1
    thread, docs/benchmarks-job-engine.md), and of a 128-row job's two shards one engine
    took both; no engine need hold more than its share."""
    rows = plan.max_rows_per_shard
    count = min(MAX_SHARDS_IN_FLIGHT, max(2, math.ceil(2 * engine.max_num_seqs / rows) + 1))
    if rows_per_actor is not None:
        count = min(count, max(1, math.ceil(rows_per_actor / rows)))
    return count


@dataclass(frozen=True)
class ShardSpread:
    """How one shuffle partition's shards should spread over the engine actors: the plan
    cuts a small partition into shards small enough that no actor's `in_flight` shards hold
    more than its share of the rows.

    Ray Data hands an actor up to `in_flight` shards, counting tasks, not rows. With
    256-row shards, 525 rows in two partitions made 256 + 6 and 256 + 7, so one engine could
    hold both large shards while the other had 13 rows, or an engine up first could take
    them (docs/benchmarks-job-engine.md, the processor on 525 Alpaca rows). The partition's
    rows times `partitions` over `actors` is the share (hash partitions are about equal; the
    job knows its rows and caps `in_flight` by the share too, `shards_in_flight`). Large
    inputs keep the full `max_rows_per_shard`."""

    partitions: int
    actors: int
    in_flight: int

    def rows_per_shard(self, partition_rows: int, max_rows: int) -> int:
        """The rows a shard of this partition may pack, at most `max_rows`."""
        share = math.ceil(partition_rows * self.partitions / self.actors)
        return max(1, min(max_rows, math.ceil(share / self.in_flight)))


def engine_actor_args(compute: ComputeConfig, placements: Any = None) -> dict:
    """Resources and restart policy of an engine actor: a GPU each when the cluster has GPUs
    (or as configured), else a fraction of a CPU; plus any custom resources and memory.

    With `placements` (pipeline.job.engine_placement.EnginePlacements, for tp x pp engines) each
    actor is created in a placement group of its own and takes no GPU itself: its workers
    hold them, one per bundle.

    The actor's process preloads `compute.allocator` (actors/allocator.py: tcmalloc where
    the machine has it) through its `runtime_env`; a tp x pp engine's workers inherit it."""
    import ray

    from actors.allocator import preload_env

    gpus = compute.num_gpus_per_actor
    if gpus is None:
        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    if compute.engines_each > 1 and (gpus or placements is not None):
        raise ValueError(
            f"engines_per_actor={compute.engines_each}: several engines share an actor on CPU "
            "only (a GPU or tensor/pipeline-parallel engine is one per actor)"
        )
    args: dict = dict(
        num_cpus=compute.actor_cpus,
        num_gpus=gpus,
        max_restarts=compute.max_restarts,
        max_task_retries=compute.max_restarts,
    )
    if compute.resources:
        args["resources"] = dict(compute.resources)
    if compute.memory_gb_per_actor:
        args["memory"] = int(compute.memory_gb_per_actor * 2**30)
    env = preload_env(compute.allocator)
    if env:
        args["runtime_env"] = {"env_vars": env}
    if placements is not None:
        args["num_gpus"] = 0
        args["ray_remote_args_fn"] = placements
    return args


def default_torch_threads(
    compute: ComputeConfig, actor_args: dict, world_size: int = 1
) -> int | None:
    """Torch threads of each engine of a CPU engine actor: the cluster's CPUs shared by all
    the engines, at most the largest node's share of an actor's engines
    (`pipeline.cluster_cpus.threads_per_actor`).

    Ray sets OMP_NUM_THREADS to an actor's whole CPUs, so a 0.5-CPU actor would run torch
    on one thread however many cores are idle; the CPU fraction is only for scheduling.
    None (torch's default) for GPU actors and for tp x pp engines (their workers compute).
    """
    if actor_args["num_gpus"] or world_size > 1:
        return None
    each = compute.engines_each
    return threads_per_actor(available_cpus(), largest_node_cpus() / each, compute.num_engines)
