"""A tensor-parallel engine behind Serve: the replica reserves its workers' bundles and its
engine places them there; greedy answers equal Hugging Face `generate`."""

from __future__ import annotations

from dataclasses import replace

import pytest
import requests

from actors.config import EngineConfig
from packing.admission import AdmissionConfig
from pipeline.serve.app import placement_options
from pipeline.serve.config import ServeConfig
from tests.serve.conftest import MODEL, Live
from tests.serve.hf_reference import HFReference

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
REPLICA_CPUS = 0.2
WORKER_CPUS = 0.4  # beside the three apps of `live` (0.2 CPU each) on a 2-CPU Ray


def tp_config(model_dir: object) -> ServeConfig:
    """tp=2 on CPU (gloo), fractional CPUs, admission immediate."""
    engine = EngineConfig(
        dtype="float32",
        model=str(model_dir),
        max_num_seqs=8,
        tensor_parallel_size=2,
        worker_num_cpus=WORKER_CPUS,
        device="cpu",
    )
    return ServeConfig(
        engine=engine,
        admission=AdmissionConfig(policy="immediate"),
        served_model_name=MODEL,
        num_cpus=REPLICA_CPUS,
        api_keys_env=None,
    )


def test_placement_options_reserve_one_bundle_per_worker() -> None:
    config = tp_config("m")
    assert placement_options(replace(config, engine=EngineConfig(dtype="float32", model="m"))) == {}
    options = placement_options(config)
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["placement_group_bundles"] == [
        {"CPU": REPLICA_CPUS + WORKER_CPUS},  # the replica sits beside worker 0
        {"CPU": WORKER_CPUS},
    ]
    pp = replace(
        config,
        engine=replace(
            config.engine,
            tensor_parallel_size=1,
            pipeline_parallel_size=3,
            placement_strategy="SPREAD",
        ),
    )
    assert placement_options(pp)["placement_group_strategy"] == "SPREAD"
    assert len(placement_options(pp)["placement_group_bundles"]) == 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp2_app_answers_like_hf_generate(live: Live) -> None:
    from ray import serve
    from ray.util.placement_group import placement_group_table

    from pipeline.serve import build_app

    hf = HFReference(live.model_dir)
    expected = [hf.greedy(p, 10) for p in PROMPTS]
    groups_before = _live_groups(placement_group_table())
    serve.run(build_app(tp_config(live.model_dir)), name="tp", route_prefix="/tp")
    try:
        groups = _live_groups(placement_group_table())
        added = [g for key, g in groups.items() if key not in groups_before]
        # one group, the replica's: the engine put its workers there instead of reserving more
        assert len(added) == 1, added
        assert list(added[0]["bundles"].values()) == [
            pytest.approx({"CPU": REPLICA_CPUS + WORKER_CPUS}),
            pytest.approx({"CPU": WORKER_CPUS}),
        ]
        for prompt, ref in zip(PROMPTS, expected, strict=True):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0}
            answer = requests.post(live.url("/v1/completions", "tp"), json=body, timeout=120)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == ref.text
    finally:
        serve.delete("tp")
    # the group went with the replica
    assert set(_live_groups(placement_group_table())) == set(groups_before)


def _live_groups(table: dict) -> dict:
    return {key: g for key, g in table.items() if g["state"] != "REMOVED"}
