"""Room for the offline job's engine actors: one placement group per tensor/pipeline-parallel
engine actor, and checks that fail fast where Ray would wait forever.

Ray Data starts the engine actors of an actor pool and restarts them; it cannot reserve a
placement group per actor itself, so `EnginePlacements` gives it one through its
`ray_remote_args_fn`: a group of tp x pp bundles per actor, the actor pinned to bundle 0
beside worker 0 (see `actors.parallel.placement.worker_bundles`), and the engine's executor
finds the group with `ray.util.get_current_placement_group()`. This is how Ray's own LLM
layer runs vLLM (`ray.data.llm`), except that the groups are reserved before the job starts
(see `EnginePlacements`) and removed when it ends.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from actors.parallel import placement
from pipeline.config import JobConfig

logger = logging.getLogger(__name__)


class NoRoomError(ValueError):
    """The cluster can never hold the job's engine actors as configured: the command exits 2
    with this message (pipeline/commands/cli.py), before any work."""


def engine_share(config: JobConfig) -> placement.Bundle:
    """What one engine actor itself asks for: its CPUs, custom resources and memory."""
    compute = config.compute
    share: placement.Bundle = {"CPU": compute.actor_cpus, **dict(compute.resources)}
    if compute.memory_gb_per_actor:
        share["memory"] = compute.memory_gb_per_actor * 2**30
    return share


def workers_use_gpus(config: JobConfig, cluster: dict[str, float]) -> bool:
    """Whether a parallel engine's workers take GPUs (the executor's own rule: CUDA when the
    engine's device says so, or when none is set and the cluster has GPUs)."""
    device = config.engine.device
    return device.startswith("cuda") if device else cluster.get("GPU", 0) > 0


def group_bundles(config: JobConfig, gpu: bool) -> list[placement.Bundle]:
    """One engine actor's placement group: a bundle per worker, the engine's share in bundle 0."""
    engine = config.engine
    return placement.worker_bundles(
        engine.world_size, engine.worker_num_cpus, gpu, engine_share(config)
    )


def group_strategy(config: JobConfig) -> str:
    """STRICT_PACK for tensor parallel alone (all-reduces stay on one node), else the
    configured strategy (SPREAD puts pipeline stages on different nodes)."""
    engine = config.engine
    return "STRICT_PACK" if engine.pipeline_parallel_size == 1 else engine.placement_strategy


class EnginePlacements:
    """The job's engine placement groups, reserved up front, and Ray Data's
    `ray_remote_args_fn` that hands them to the engine actors.

    Ray Data calls that function before it starts each actor, but also elsewhere (its memory
    issue detector reads the `memory` it returns), so a function that made a group per call
    would leak groups that hold resources and can starve the job's other tasks. Instead the
    `num_groups` groups are reserved here (waiting for them with a timeout, so a busy cluster
    is an error, not a hang), and each call hands out the next one in turn: any `num_groups`
    consecutive calls, such as the pool's start, cover every group once. A restarted actor
    keeps its group (Ray restarts it in place).
    """

    def __init__(
        self,
        bundles: list[placement.Bundle],
        strategy: str,
        num_groups: int,
        timeout_s: float,
        check_nodes: bool = True,
    ) -> None:
        self.bundles = bundles
        self.strategy = strategy
        prefix = f"raypack-engine-{uuid.uuid4().hex[:8]}"
        self.groups: list[Any] = []
        self._calls = 0
        try:
            for i in range(num_groups):
                self.groups.append(
                    placement.reserve(
                        bundles, strategy, timeout_s, name=f"{prefix}-{i}", check_nodes=check_nodes
                    )
                )
        except BaseException:
            self.remove_all()
            raise
        logger.info("%d engine placement groups of %s (%s)", num_groups, bundles, strategy)

    def __call__(self) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = self.groups[self._calls % len(self.groups)]
        self._calls += 1
        # Not captured: Ray Data's and the engine's other tasks must not queue for the bundles.
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
        return {"scheduling_strategy": strategy}

    def remove_all(self) -> None:
        """Release every group (the engine actors are gone by then)."""
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups:
            remove_placement_group(pg)
        self.groups = []


def check_groups_fit(config: JobConfig, gpu: bool, nodes: list[dict[str, float]]) -> None:
    """ValueError when the cluster's nodes can never hold `num_actors` engine groups."""
    bundles = group_bundles(config, gpu)
    strategy = group_strategy(config)
    num = config.compute.num_actors
    problem = placement.groups_infeasible(bundles, strategy, num, nodes)
    if problem is not None:
        raise NoRoomError(
            f"{num} engine actors with tp={config.engine.tensor_parallel_size} x "
            f"pp={config.engine.pipeline_parallel_size} need {num} placement groups of "
            f"{bundles} ({strategy}), which can never be placed: {problem}; the cluster's nodes "
            f"have {nodes}. Lower --num-actors or --worker-num-cpus, or add nodes."
        )


def check_cpu_room(config: JobConfig, gpu: bool, nodes: list[dict[str, float]]) -> None:
    """ValueError when the actors would leave no node with a whole CPU free.

    Ray Data lists input files in a task that asks for one whole CPU, and the actor pools take
    their CPUs first: with no whole CPU left on any node the job waits forever without an
    error (on a 2-core machine, two engine actors of one CPU each do this). The actors'
    CPUs are packed onto the nodes largest first, each where it leaves the least room (the
    arrangement that keeps whole CPUs free); if even that leaves none, Ray's will not either.
    """
    compute = config.compute
    if config.engine.world_size > 1:
        bundles = [b.get("CPU", 0.0) for b in group_bundles(config, gpu)]
        per_actor = [sum(bundles)] if group_strategy(config) == "STRICT_PACK" else bundles
    else:
        per_actor = [compute.actor_cpus]
    demands = per_actor * compute.num_actors + [compute.tokenize_num_cpus] * (
        compute.num_tokenize_actors
    )
    free = [node.get("CPU", 0.0) for node in nodes]
    for demand in sorted(demands, reverse=True):
        fits = [i for i, room in enumerate(free) if room + 1e-9 >= demand]
        if not fits:
            free = []
            break
        best = min(fits, key=lambda i: free[i])
        free[best] -= demand
    if not any(room + 1e-9 >= 1 for room in free):
        held = sum(demands)
        raise NoRoomError(
            f"the engine and tokenizer actors hold {held:g} CPUs ({sorted(demands, reverse=True)})"
            f" of nodes with {[n.get('CPU', 0.0) for n in nodes]} CPUs and leave no node with a "
            "whole CPU free; Ray Data needs one for its read tasks or the job hangs. Lower "
            "--num-cpus-per-actor, --worker-num-cpus or --num-actors."
        )


def actor_demand(config: JobConfig, cluster_has_gpus: bool) -> placement.Bundle:
    """One single-process engine actor's resources, as `engine_actor_args` asks Ray for them."""
    gpus = config.compute.num_gpus_per_actor
    if gpus is None:
        gpus = 1.0 if cluster_has_gpus else 0.0
    demand = {k: v for k, v in engine_share(config).items() if v}
    if gpus:
        demand["GPU"] = gpus
    return demand


def check_actors_fit(
    config: JobConfig, cluster_has_gpus: bool, nodes: list[dict[str, float]]
) -> None:
    """ValueError, with the arithmetic, when the nodes can never hold `num_actors`
    single-process engine actors (CPUs, GPUs, custom resources, memory): Ray Data would wait
    for the missing actors forever. Each node holds as many as its scarcest resource allows."""
    demand = actor_demand(config, cluster_has_gpus)
    num = config.compute.num_actors
    per_node = [
        min((int(node.get(k, 0.0) / v + 1e-9) for k, v in demand.items()), default=num)
        for node in nodes
    ]
    if sum(per_node) >= num:
        return
    shown = {k: (f"{v / 2**30:g} GiB" if k == "memory" else v) for k, v in demand.items()}
    raise NoRoomError(
        f"--num-actors {num} engine actors of {shown} each need "
        + ", ".join(f"{k} {num * v:g}" for k, v in demand.items() if k != "memory")
        + f", but the cluster's nodes ({nodes}) hold at most {sum(per_node)} of them "
        f"({per_node} per node). Lower --num-actors, or the share per actor "
        "(--num-cpus-per-actor, --num-gpus-per-actor, --actor-resource, --memory-gb-per-actor)."
    )
