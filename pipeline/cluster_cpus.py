"""The CPUs a Ray cluster offers, for sizing actors' torch threads (the job's engine actors,
Serve's replicas): the whole cluster's, and its largest node's (no one actor computes on more
cores than its node has)."""

from __future__ import annotations

from actors.build_thread import usable_cores


def available_cpus() -> float:
    """The Ray cluster's CPUs when connected, else this machine's (what a local Ray gets)."""
    import ray

    if ray.is_initialized():
        return float(ray.cluster_resources().get("CPU", 0.0))
    return float(usable_cores())


def largest_node_cpus() -> float:
    """The CPUs of the cluster's largest live node when connected, else this machine's."""
    import ray

    if ray.is_initialized():
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        return max((float(n["Resources"].get("CPU", 0.0)) for n in nodes), default=1.0)
    return available_cpus()


def threads_per_actor(cluster_cpus: float, node_cpus: float, actors: int) -> int:
    """Torch threads for each of `actors` actors sharing a cluster's CPUs: an equal share,
    at least one, never more than the largest node's CPUs (an actor runs on one node: a share
    of a 2-node cluster taken whole by one actor would oversubscribe its node twice)."""
    return max(1, min(int(node_cpus), int(cluster_cpus // max(1, actors))))
