"""An engine whose actor already runs in a placement group (one group per engine actor, as the
offline job and Ray's LLM layer give them) puts its workers in that group and leaves it to its
owner; the bundle layout and the group arithmetic behind it. Its tp=2 engine (prefix groups,
shared-prefix attention) is also the parallel matrix's llama case
(test_parallel_architectures.py)."""

from __future__ import annotations

import pytest
import ray
from ray.util.placement_group import (
    get_current_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors import LLMEngine, SamplingParams
from actors.parallel import placement
from tests.parallel.conftest import MAX_TOKENS, assert_same_tokens, engine_config, run_engine

ENGINE_SHARE = {"CPU": 0.25}


def test_worker_bundles_put_the_engine_beside_worker_0() -> None:
    assert placement.worker_bundles(3, 0.5, gpu=True, engine_share={"CPU": 1.0, "x": 0}) == [
        {"CPU": 1.5, "GPU": 1.0},
        {"CPU": 0.5, "GPU": 1.0},
        {"CPU": 0.5, "GPU": 1.0},
    ]
    assert placement.worker_bundles(1, 1.0, gpu=False) == [{"CPU": 1.0}]


def test_check_holds_names_the_missing_bundle() -> None:
    workers = placement.worker_bundles(2, 1.0, gpu=True)
    assert (
        placement.check_holds([{"CPU": 2.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}], workers) is None
    )
    assert "has 1 bundles" in str(placement.check_holds([{"CPU": 9.0, "GPU": 9.0}], workers))
    assert "bundle 1 {'CPU': 1.0} cannot hold" in str(
        placement.check_holds([{"CPU": 2.0, "GPU": 1.0}, {"CPU": 1.0}], workers)
    )


def test_groups_infeasible_counts_whole_groups() -> None:
    nodes = [{"CPU": 3.0, "GPU": 2.0}, {"CPU": 3.0, "GPU": 2.0}]
    pair = [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert placement.groups_infeasible(pair, "STRICT_PACK", 2, nodes) is None
    assert "the nodes hold 2" in str(placement.groups_infeasible(pair, "STRICT_PACK", 3, nodes))
    triple = [{"CPU": 1.0, "GPU": 1.0}] * 3  # PACK may split a group across nodes
    assert placement.groups_infeasible(triple, "PACK", 1, nodes) is None
    assert "2 groups need" in str(placement.groups_infeasible(triple, "PACK", 2, nodes))
    assert "fits no single node" in str(
        placement.groups_infeasible([{"GPU": 3.0}], "PACK", 1, nodes)
    )


@ray.remote
class EngineHost:
    """An engine actor as Ray Data or Serve would start it: inside its own placement group."""

    def run(self, config, prompts, groups) -> dict:
        engine = LLMEngine(config)
        runner = engine.runner
        info = {
            "same_group": runner.pg == get_current_placement_group(),
            "owns": runner.owns_placement_group,
            # live ones: the folder's Ray keeps earlier tests' removed groups in the table
            "groups_while_running": sum(
                g["state"] != "REMOVED" for g in placement_group_table().values()
            ),
        }
        try:
            outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), groups)
        finally:
            runner.shutdown()
        info["tokens"] = [o.token_ids for o in outputs]
        return info

    def build(self, config) -> None:
        LLMEngine(config)


def _host_in_group(bundles):
    pg = placement_group(bundles, strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    host = EngineHost.options(
        num_cpus=ENGINE_SHARE["CPU"],
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
    ).remote()
    return pg, host


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tp_engine_uses_its_actors_group_and_refuses_one_too_small(
    ray_local, llama_dir, prompts_and_groups
) -> None:
    prompts, groups = prompts_and_groups
    config = engine_config(llama_dir, tensor_parallel_size=2)
    pg, host = _host_in_group(placement.worker_bundles(2, 0.25, False, ENGINE_SHARE))
    try:
        # A group too small for the workers (4 of tp 2 x pp 2 in 2 bundles) is a clear error
        # before any worker starts; the same actor then runs the engine that fits.
        too_many = engine_config(llama_dir, tensor_parallel_size=2, pipeline_parallel_size=2)
        with pytest.raises(ValueError, match="has 2 bundles and the engine needs one per worker"):
            ray.get(host.build.remote(too_many), timeout=90)
        info = ray.get(host.run.remote(config, prompts, groups), timeout=180)
        assert info["same_group"] and not info["owns"]
        assert info["groups_while_running"] == 1  # no second group reserved
        assert placement_group_table(pg)["state"] == "CREATED"  # left to its owner
    finally:
        ray.kill(host)
        remove_placement_group(pg)
    expected = run_engine(engine_config(llama_dir), prompts, groups)
    assert_same_tokens(llama_dir, prompts, info["tokens"], expected)
