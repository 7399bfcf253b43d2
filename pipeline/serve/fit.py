"""The replicas' CPU share, fitted to the Ray cluster, or a clear refusal.

Serve waits for resources without end: replicas that ask for more CPUs than the cluster has
are logged "taken more than 30s to be scheduled" every 30 s and the app never becomes healthy
(`raypack serve --num-replicas 2` with one CPU each, plus the routing front's share, on a
2-core machine). So `build_app` settles the share before Serve sees it:

- `--num-cpus` unset: (cluster CPUs - the front's share) / replicas (the most replicas, when
  autoscaling), at most 1 CPU (the share a replica had before it was fitted) and rounded down
  to 0.01; below `MIN_REPLICA_CPUS` the replicas do not fit and the app is refused;
- `--num-cpus` set: refused when the replicas (the fewest, when autoscaling), their tp x pp
  workers and the front need more CPUs than the cluster has.

A fitted share also sets the replicas' torch threads (unless given): the cluster's CPUs
less the front's, per replica (the most, when autoscaling), rounded, at least 1, at most the
largest node's CPUs. Ray sets an
actor's OMP_NUM_THREADS to the floor of its CPUs, so a fitted 1-CPU replica alone on 2 cores
(or 32) would compute on one thread; as for the job's engine actors
(pipeline/stages/engine_actor.py `default_torch_threads`), the share is for scheduling.

A refusal is a ValueError naming `--num-cpus` / `--num-replicas` and the CPUs available:
`raypack serve` exits 2 with it within seconds, `serve run` prints it.

The cluster's CPUs: Ray's own count when this process is connected; else (Serve's CLI calls
the app builder before it starts or joins Ray) the CPUs of this machine, which a local Ray
started by `serve run` gets; under `serve run --address` of a remote cluster that guess is
wrong, so a builder there should run connected (`RAY_ADDRESS`, or `serve deploy`).
"""

from __future__ import annotations

import math
from dataclasses import replace

from pipeline.cluster_cpus import available_cpus, largest_node_cpus
from pipeline.serve.config import ServeConfig

MIN_REPLICA_CPUS = 0.25  # a fitted share below this is refused (too many replicas)
MAX_FITTED_CPUS = 1.0  # a fitted share above this is capped (the share an unfitted replica had)
FRONT_NUM_CPUS = 0.1  # the prefix-routing front's replica: it reads bodies and passes them on


def replica_cpus(
    cluster_cpus: float,
    replicas: tuple[int, int],
    front_cpus: float,
    requested: float | None,
    worker_cpus: float = 0.0,
) -> float:
    """The CPUs each replica's actor asks for: `requested`, checked, or fitted to the cluster.

    `replicas`: (fewest, most) replicas (the same for a fixed count); `front_cpus`: the
    routing front's share (0 without one); `worker_cpus`: CPUs of one replica's tp x pp workers
    (0 for a single-process engine). ValueError naming the flags when it cannot fit."""
    fewest, most = replicas
    room = cluster_cpus - front_cpus - most * worker_cpus
    count = _count(replicas)
    front = f" + {front_cpus:g} for the prefix-routing front" if front_cpus else ""
    workers = f" + {worker_cpus:g} for its tp x pp workers" if worker_cpus else ""
    if requested is None:
        share = min(MAX_FITTED_CPUS, math.floor(100 * room / most) / 100)
        if share < MIN_REPLICA_CPUS:
            raise ValueError(
                f"{count} do not fit in the Ray cluster's {cluster_cpus:g} CPUs: each would get "
                f"{max(share, 0):g} CPUs (({cluster_cpus:g} CPUs{front.replace(' + ', ' - ')}"
                f"{' - workers' if worker_cpus else ''}) / {most}), under the floor of "
                f"{MIN_REPLICA_CPUS:g}; lower --num-replicas (or --max-replicas), or set "
                "--num-cpus to the share you want"
            )
        return share
    need = fewest * (requested + worker_cpus) + front_cpus
    if need > cluster_cpus + 1e-9:
        fits = math.floor(100 * (cluster_cpus - front_cpus - fewest * worker_cpus) / fewest) / 100
        hint = f" (at most {fits:g} fits)" if fits > 0 else ""
        raise ValueError(
            f"{count} of --num-cpus {requested:g}{workers}{front} need {need:g} CPUs, but the "
            f"Ray cluster has {cluster_cpus:g}: lower --num-cpus{hint} or --num-replicas, or "
            "leave --num-cpus unset to fit the replicas to the cluster"
        )
    return requested


def fit_to_cluster(
    config: ServeConfig, routed: bool, cluster_cpus: float | None = None
) -> ServeConfig:
    """`config` with `num_cpus` settled against the cluster (see the module docstring);
    `routed`: whether the app has the prefix-routing front (`config.prefix_routed`);
    `cluster_cpus` defaults to `available_cpus()`."""
    engine = config.engine
    worker_cpus = engine.world_size * engine.worker_num_cpus if engine.world_size > 1 else 0.0
    cpus = available_cpus() if cluster_cpus is None else cluster_cpus
    node = largest_node_cpus() if cluster_cpus is None else cluster_cpus  # a replica's most
    front = FRONT_NUM_CPUS if routed else 0.0
    share = replica_cpus(
        cpus,
        (config.replicas.lowest, config.replicas.highest),
        front,
        config.num_cpus,
        worker_cpus,
    )
    threads = config.torch_threads
    if threads is None and config.num_cpus is None and engine.world_size == 1:
        threads = max(1, min(int(node), round((cpus - front) / config.replicas.highest)))
    return replace(config, num_cpus=share, torch_threads=threads)


def _count(replicas: tuple[int, int]) -> str:
    fewest, most = replicas
    if fewest == most:
        return f"--num-replicas {most}"
    return f"--min-replicas {fewest} (of at most {most})"
