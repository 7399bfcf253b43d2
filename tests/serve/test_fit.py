"""Replicas fitted to the cluster's CPUs, or refused at once naming the flags
(pipeline/serve/fit.py): the arithmetic without Ray, the app builder as `serve run` calls it,
and `raypack serve` exiting 2 within seconds where Serve would wait forever."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.config import EngineConfig
from pipeline.serve import ServeConfig
from pipeline.serve.app import prefix_routed
from pipeline.serve.fit import FRONT_NUM_CPUS, MIN_REPLICA_CPUS, fit_to_cluster, replica_cpus
from pipeline.serve.replicas import Replicas

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


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_raypack_serve_refuses_replicas_the_cluster_cannot_hold(tmp_path) -> None:
    """The issue's case: 2 replicas of 1 CPU each plus the front on a 2-CPU Ray. Exit 2 naming
    the flags and the CPUs, long before Serve would report anything (a guard, not a timing)."""
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "jobs/serve.py",
            "--ray-num-cpus",
            "2",
            "--num-replicas",
            "2",
            "--num-cpus",
            "1",
            "--model",
            "smollm2",
        ],  # fmt: skip
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "--num-cpus" in done.stderr and "--num-replicas 2" in done.stderr
    assert "the Ray cluster has 2" in done.stderr
    assert time.monotonic() - started < 110
