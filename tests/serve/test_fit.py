"""Replicas fitted to the cluster's CPUs, or refused at once naming the flags
(pipeline/serve/fit.py): the arithmetic without Ray, the app builder as `serve run` calls it,
and `raypack serve` exiting 2 within seconds where Serve would wait forever: before it starts
a local Ray of `--ray-num-cpus` CPUs, and once connected to a cluster it joins."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from actors.config import EngineConfig
from pipeline.commands.serve import build_parser, local_ray_cpus
from pipeline.serve import ServeConfig
from pipeline.serve.config import prefix_routed
from pipeline.serve.fit import FRONT_NUM_CPUS, MIN_REPLICA_CPUS, fit_to_cluster, replica_cpus
from pipeline.serve.replicas import Replicas
from pipeline.serve.staging import step_thread
from tests.serve.conftest import ServeInstance

REPO = Path(__file__).resolve().parents[2]


def test_an_unset_share_fits_the_cluster() -> None:
    # Two replicas and the front on 2 CPUs: (2 - 0.1) / 2.
    assert replica_cpus(2, (2, 2), FRONT_NUM_CPUS, None) == 0.95
    # One replica, no front: the whole CPU it always had, not more.
    assert replica_cpus(2, (1, 1), 0.0, None) == 1.0
    assert replica_cpus(64, (4, 4), FRONT_NUM_CPUS, None) == 1.0
    # Three on 2 CPUs: rounded down to 0.01, so the sum never passes the cluster.
    share = replica_cpus(2, (3, 3), FRONT_NUM_CPUS, None)
    assert share == 0.63 and 3 * share + FRONT_NUM_CPUS <= 2
    # Autoscaling: fitted for the most replicas.
    assert replica_cpus(4, (1, 4), FRONT_NUM_CPUS, None) == 0.97
    # tp x pp workers' CPUs come first: (4 - 0.1 - 2 x 1.0) / 2.
    assert replica_cpus(4, (2, 2), FRONT_NUM_CPUS, None, worker_cpus=1.0) == 0.95


def test_too_many_replicas_for_the_floor_are_refused() -> None:
    with pytest.raises(ValueError) as refused:
        replica_cpus(2, (10, 10), FRONT_NUM_CPUS, None)
    text = str(refused.value)
    assert "--num-replicas 10" in text and "2 CPUs" in text and "--num-cpus" in text
    assert f"{MIN_REPLICA_CPUS:g}" in text


def test_a_share_over_the_cluster_is_refused_with_the_arithmetic() -> None:
    with pytest.raises(ValueError) as refused:
        replica_cpus(2, (2, 2), FRONT_NUM_CPUS, 1.0)
    text = str(refused.value)
    assert "--num-replicas 2 of --num-cpus 1" in text
    assert "need 2.1 CPUs, but the Ray cluster has 2" in text
    assert "at most 0.95 fits" in text
    assert replica_cpus(2, (2, 2), FRONT_NUM_CPUS, 0.95) == 0.95  # what the hint says fits
    # Autoscaling: the fewest replicas must fit; more wait for the autoscaler.
    assert replica_cpus(2, (1, 8), FRONT_NUM_CPUS, 1.0) == 1.0
    with pytest.raises(ValueError, match="--min-replicas 3 .of at most 8."):
        replica_cpus(2, (3, 8), FRONT_NUM_CPUS, 1.0)


def test_the_builder_fits_the_config_as_serve_run_calls_it() -> None:
    base = ServeConfig(engine=EngineConfig(dtype="float32", model="m", device="cpu"))
    assert base.num_cpus is None  # unset until the app is built
    two = ServeConfig(engine=base.engine, replicas=Replicas(num_replicas=2))
    assert fit_to_cluster(two, prefix_routed(two), cluster_cpus=2).num_cpus == 0.95
    no_front = ServeConfig(
        engine=base.engine, replicas=Replicas(num_replicas=2), prefix_routing=False
    )
    assert fit_to_cluster(no_front, prefix_routed(no_front), cluster_cpus=2).num_cpus == 1.0
    asked = ServeConfig(engine=base.engine, replicas=Replicas(num_replicas=2), num_cpus=1.0)
    with pytest.raises(ValueError, match="--num-cpus"):
        fit_to_cluster(asked, prefix_routed(asked), cluster_cpus=2)


def test_a_fitted_replica_computes_on_the_cluster_s_cpus_per_replica() -> None:
    """The fitted share is capped at one CPU for scheduling; the engine's torch threads are the
    cluster's CPUs (less the front's) per replica, at least 1; set by the step thread."""
    engine = EngineConfig(dtype="float32", model="m", device="cpu")

    def threads(cluster: float, replicas: Replicas, **kw) -> int | None:  # noqa: ANN003
        config = ServeConfig(engine=engine, replicas=replicas, **kw)
        fitted = fit_to_cluster(config, prefix_routed(config), cluster_cpus=cluster)
        again = fit_to_cluster(fitted, prefix_routed(fitted), cluster_cpus=cluster)
        assert again.torch_threads == fitted.torch_threads  # the builder fits once more
        return fitted.torch_threads

    one = Replicas(num_replicas=1)
    assert threads(2, one) == 2  # share 1.0, but both cores compute
    assert threads(32, one) == 32
    assert threads(2, Replicas(num_replicas=2)) == 1  # (2 - 0.1 for the front) / 2
    assert threads(8, Replicas(min_replicas=1, max_replicas=4)) == 2  # the most replicas
    assert threads(2, one, num_cpus=0.5) is None  # asked: Ray's (floor of the share, >= 1)
    assert threads(2, one, torch_threads=1) == 1
    tp = ServeConfig(engine=replace(engine, tensor_parallel_size=2, worker_num_cpus=0.5))
    assert fit_to_cluster(tp, prefix_routed(tp), cluster_cpus=4).torch_threads is None
    for count in (1, 3):
        assert step_thread(count).submit(torch.get_num_threads).result() == count


def test_the_command_knows_the_cpus_of_the_ray_it_starts() -> None:
    def cpus(flags: list[str], environ: dict[str, str]) -> int | None:
        return local_ray_cpus(build_parser().parse_args(flags), environ)

    assert cpus(["--ray-num-cpus", "2"], {}) == 2
    assert cpus(["--ray-num-cpus", "2", "--address", "local"], {"RAY_ADDRESS": "h:1"}) == 2
    assert cpus(["--ray-num-cpus", "2"], {"RAY_ADDRESS": "h:1"}) is None  # ray.init joins it
    assert cpus(["--address", "h:1"], {}) is None
    assert cpus([], {}) is None  # Ray counts them: fitted once it runs


def refused(*flags: str) -> subprocess.CompletedProcess[str]:
    """`raypack serve` (jobs/serve.py) asking for 2 replicas of 1 CPU each (plus the front)
    with `flags`: it must exit 2 naming the flags and the CPUs, long before Serve would report
    anything (the timeout is a guard, not a timing)."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    command = [sys.executable, "jobs/serve.py", "--num-replicas", "2", "--num-cpus", "1"]
    done = subprocess.run(
        [*command, "--model", "smollm2", *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "--num-cpus" in done.stderr and "--num-replicas 2" in done.stderr
    assert "the Ray cluster has 2" in done.stderr
    return done


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_raypack_serve_refuses_replicas_a_local_ray_cannot_hold_before_starting_it() -> None:
    """The issue's case on a 2-CPU local Ray: refused from the flags alone."""
    done = refused("--ray-num-cpus", "2")
    assert "Started a local Ray instance" not in done.stderr  # Ray's own line when it starts


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_raypack_serve_refuses_replicas_the_cluster_it_joins_cannot_hold(
    serve_instance: ServeInstance,
) -> None:
    """Joining a running cluster (the session's 2-CPU Ray): refused once connected, from the
    cluster's own count. Its Serve is left alone (the command never reaches serve.start)."""
    import ray

    refused("--address", ray.get_runtime_context().gcs_address)
