"""Reserve a placement group, or fail with a clear message instead of waiting forever.

A Ray placement group that cannot be placed stays PENDING with no error. `reserve` first
checks that the bundles can fit the cluster's nodes at all (an immediate `ValueError`), then
waits for the group with a timeout (a `TimeoutError` naming what was asked and what is free).

An engine whose own actor already runs in a placement group (a Ray Data actor given one
group per actor, a Serve replica with `placement_group_bundles`) uses that group instead:
`worker_bundles` is the layout both sides agree on (bundle `stage * tp + rank` per worker, the
engine actor's own share added to bundle 0), and `check_holds` says why a group cannot take
the workers. This is how Ray's LLM layer runs vLLM (one group per engine replica, workers
found through `ray.util.get_current_placement_group()`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

if TYPE_CHECKING:
    from actors.config import EngineConfig

logger = logging.getLogger(__name__)

Bundle = dict[str, float]


def reserve(
    bundles: list[Bundle],
    strategy: str,
    timeout_s: float,
    name: str = "",
    check_nodes: bool = True,
) -> PlacementGroup:
    """A ready placement group of `bundles` placed with `strategy`.

    Raises `ValueError` when the bundles can never fit the cluster's nodes (unless not
    `check_nodes`: an autoscaler may add nodes), and `TimeoutError` (after removing the group)
    when they are not placed in time.
    """
    nodes = node_resources()
    problem = infeasible(bundles, strategy, nodes) if check_nodes else None
    if problem is not None:
        raise ValueError(
            f"placement group {name!r} of {len(bundles)} bundles {bundles} ({strategy}) can "
            f"never be placed: {problem}; the cluster's nodes have {nodes}"
        )
    pg: PlacementGroup = placement_group(bundles, strategy=strategy, name=name)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise TimeoutError(
            f"placement group {name!r} of {len(bundles)} bundles {bundles} ({strategy}) was not "
            f"placed within {timeout_s:g} s; the cluster has {_user(_ray().cluster_resources())} "
            f"in all and {_user(_ray().available_resources())} free (other actors or placement "
            "groups hold the rest)"
        ) from None
    return pg


def worker_bundles(
    world_size: int, worker_num_cpus: float, gpu: bool, engine_share: Bundle | None = None
) -> list[Bundle]:
    """The bundles of one tp x pp engine: one per worker (a GPU each when `gpu`), stage-major;
    `engine_share` (the engine actor's own resources) is added to bundle 0, so the engine
    actor sits beside worker 0 (stage 0, tp rank 0) and a group holds a whole engine."""
    bundle: Bundle = {"CPU": worker_num_cpus}
    if gpu:
        bundle["GPU"] = 1.0
    bundles = [dict(bundle) for _ in range(world_size)]
    for key, value in (engine_share or {}).items():
        if value:
            bundles[0][key] = bundles[0].get(key, 0.0) + value
    return bundles


def check_holds(group_bundles: list[Bundle], workers: list[Bundle]) -> str | None:
    """Why a placement group of `group_bundles` cannot take `workers` (worker i in bundle i),
    or None when it can (bundle 0's engine share is not known here and not checked)."""
    if len(group_bundles) < len(workers):
        return (
            f"the group has {len(group_bundles)} bundles and the engine needs one per worker "
            f"({len(workers)}: tensor_parallel_size x pipeline_parallel_size)"
        )
    for i, (have, need) in enumerate(zip(group_bundles, workers, strict=False)):
        if not _fits(need, _user(have)):
            return f"bundle {i} {_user(have)} cannot hold worker {i}'s {need}"
    return None


def groups_infeasible(
    bundles: list[Bundle], strategy: str, num_groups: int, nodes: list[dict[str, float]]
) -> str | None:
    """Why `num_groups` placement groups of `bundles` can never all be placed on `nodes`, or
    None when they can (a per-group check, then the sum; STRICT_PACK groups counted per
    node). Ignores what other groups hold now."""
    problem = infeasible(bundles, strategy, nodes)
    if problem is not None or num_groups <= 1:
        return problem
    total = _sum(bundles)
    if strategy == "STRICT_PACK":
        fit = sum(_times(total, node) for node in nodes)
        if fit < num_groups:
            return f"{num_groups} groups of {total} each on one node: the nodes hold {fit}"
        return None
    need = {key: value * num_groups for key, value in total.items()}
    if not _fits(need, _sum(nodes)):
        return f"{num_groups} groups need {need} in all"
    return None


def node_resources() -> list[dict[str, float]]:
    """Total resources of each alive node (without Ray's internal node/memory keys)."""
    out = []
    for node in _ray().nodes():
        if node.get("Alive"):
            res: dict[str, Any] = node.get("Resources", {})
            out.append(_user(res))
    return out


def infeasible(bundles: list[Bundle], strategy: str, nodes: list[dict[str, float]]) -> str | None:
    """Why `bundles` can never be placed on `nodes` with `strategy`, or None when they can
    (ignoring what other groups hold now)."""
    if not bundles:
        return "no bundles"
    for i, bundle in enumerate(bundles):
        if not any(_fits(bundle, node) for node in nodes):
            return f"bundle {i} {bundle} fits no single node"
    if strategy == "STRICT_PACK":
        total = _sum(bundles)
        if not any(_fits(total, node) for node in nodes):
            return f"STRICT_PACK needs {total} on one node"
    elif strategy == "STRICT_SPREAD":
        usable = [n for n in nodes if any(_fits(b, n) for b in bundles)]
        if len(usable) < len(bundles):
            return f"STRICT_SPREAD needs {len(bundles)} nodes, {len(usable)} can take a bundle"
    else:
        total = _sum(bundles)
        cluster = _sum(nodes)
        if not _fits(total, cluster):
            return f"the bundles need {total} in all"
    return None


def worker_device(config: EngineConfig) -> str:
    """The workers' device: `config.device`, else CUDA when the cluster has GPUs. The engine
    actor of a tp x pp engine holds no GPU itself (its workers do), so it must not look at its
    own `torch.cuda.is_available()`."""
    if config.device:
        return config.device
    if not ray.is_initialized():
        ray.init()
    return "cuda" if _ray().cluster_resources().get("GPU") else "cpu"


def _ray() -> Any:
    """Ray's API, untyped (its functions carry no annotations)."""
    return ray


def _user(resources: dict[str, Any]) -> dict[str, float]:
    """Resources as users ask for them (no node ids, memory, or placement-group entries)."""
    return {
        key: float(value)
        for key, value in resources.items()
        if not key.startswith("node:")
        and key not in ("memory", "object_store_memory")
        and "_group_" not in key
        and not key.startswith("bundle_group")
    }


def _sum(items: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for item in items:
        for key, value in item.items():
            total[key] = total.get(key, 0.0) + value
    return total


def _times(demand: dict[str, float], capacity: dict[str, float]) -> int:
    """How many times `demand` fits in `capacity`."""
    counts = [int(capacity.get(k, 0.0) / v + 1e-9) for k, v in demand.items() if v > 0]
    return min(counts) if counts else 0


def _fits(demand: dict[str, float], capacity: dict[str, float]) -> bool:
    return all(capacity.get(key, 0.0) + 1e-9 >= value for key, value in demand.items())
