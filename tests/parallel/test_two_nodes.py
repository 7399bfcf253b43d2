"""A pipeline-parallel engine across two simulated nodes (`ray.cluster_utils.Cluster`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import ray

from actors import LLMEngine, SamplingParams
from tests.parallel.conftest import assert_same_tokens, engine_config, run_engine


@pytest.fixture
def two_nodes():
    """A head with no CPUs and two 1-CPU nodes (RAY_TMPDIR set: Cluster's temp-dir bug); the
    folder's local Ray (conftest's ray_local), if up, is ended first: a process joins one Ray."""
    from ray.cluster_utils import Cluster

    ray.shutdown()

    tmp = Path(tempfile.mkdtemp(prefix="rpc", dir="/tmp"))
    (tmp / "ray").mkdir()
    before = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = str(tmp)
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
    )
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if before is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = before
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_pipeline_across_two_simulated_nodes(two_nodes, llama_dir, prompts_and_groups) -> None:
    prompts, groups = prompts_and_groups
    config = engine_config(llama_dir, pipeline_parallel_size=2, worker_num_cpus=1.0)
    engine = LLMEngine(config)
    try:
        nodes = ray.get([stage[0].node_id.remote() for stage in engine.runner.workers])
        assert len(set(nodes)) == 2  # one stage per node: 1-CPU bundles cannot share one
        outputs = engine.generate(prompts, SamplingParams(max_tokens=8), groups)
    finally:
        engine.runner.shutdown()
    expected = run_engine(engine_config(llama_dir), prompts, groups)
    assert_same_tokens(llama_dir, prompts, [o.token_ids for o in outputs], expected)
