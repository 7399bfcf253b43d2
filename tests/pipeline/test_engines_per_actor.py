"""Several engines in one engine actor (`ComputeConfig.engines_per_actor`): the stage builds a
feed per engine, hands each shard to the feed with the fewest rows to finish, and its rows
are the tokens one engine gives; the job pairs a single node's auto-counted CPU engines
(pipeline/job/engine_count.py). No Ray: the stage is called in process from several threads,
as Ray Data's concurrent calls reach an actor (the job's own test with Ray: test_job.py's
snippets test)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from actors.config import EngineConfig, SamplingParams
from pipeline.config import ComputeConfig, PlanConfig
from pipeline.job.engine_count import Node, engine_processes, resolve_engines
from pipeline.stages import stage
from pipeline.stages.engine_actor import default_torch_threads, engine_actor_args
from pipeline.stages.infer import InferStage
from pipeline.stages.plan import plan_partition
from tests.pipeline.test_engine_count import SMALL, TWO_CORES, job
from tests.pipeline.test_plan_infer import DOC_A, DOC_B, tokenized

GiB = 2**30


def _shards():
    """Eight rows, two documents' prefix groups and lone prompts, in 2-row shards."""
    rows = [(f"a{i}", DOC_A + [400 + i] * (i + 1), None) for i in range(3)]
    rows += [(f"b{i}", DOC_B + [500 + i], None) for i in range(3)]
    rows += [("solo0", [7, 8, 9], None), ("solo1", list(range(600, 640)), None)]
    shards, _ = plan_partition(
        tokenized(rows), PlanConfig(max_rows_per_shard=2), SamplingParams(max_tokens=12), []
    )
    return [shards.slice(i, 1) for i in range(shards.num_rows)]


def _tokens(tables) -> dict[str, list[int]]:
    return {
        row[stage.ID]: row[stage.GENERATED_TOKEN_IDS]
        for table in tables
        for row in table.to_pylist()
    }


def test_two_engines_in_one_stage_give_the_tokens_of_one(tiny_model_dir: Path) -> None:
    engine = EngineConfig(model=str(tiny_model_dir), dtype="float32")
    sampling = SamplingParams(max_tokens=12)
    shards = _shards()
    assert len(shards) >= 4
    one = InferStage(engine, sampling, torch_threads=1)
    want = _tokens(one(s) for s in shards)
    two = InferStage(engine, sampling, torch_threads=1, engines=2)
    assert len(two.feeds) == 2 and two.feeds[0].engine is not two.feeds[1].engine
    assert two.feeds[1].engine.model is two.feeds[0].engine.model  # loaded once
    start = threading.Barrier(len(shards))

    def call(shard):  # noqa: ANN001, ANN202 (a Ray Data call of the actor, in its thread)
        start.wait()
        return two(shard)

    with ThreadPoolExecutor(len(shards)) as pool:
        got = _tokens(pool.map(call, shards))
    assert got == want and len(got) == 8
    assert all(any(tokens) for tokens in got.values())
    # both engines stepped: the second shard went to the feed with nothing to finish
    assert all(feed.first_step_at is not None for feed in two.feeds)
    assert two._unfinished == [0, 0]


def test_a_single_nodes_auto_engines_run_in_pairs() -> None:
    assert engine_processes(2, "auto", num_nodes=1) == (1, 2)
    assert engine_processes(8, "auto", num_nodes=1) == (4, 2)
    assert engine_processes(3, "auto", num_nodes=1) == (3, 1)  # odd: one per actor
    assert engine_processes(4, "auto", num_nodes=2) == (4, 1)  # Ray places the actors
    assert engine_processes(1, "auto", num_nodes=1) == (1, 1)
    assert engine_processes(6, 3, num_nodes=2) == (2, 3)  # given: as many as they fill
    assert engine_processes(2, 4, num_nodes=1) == (1, 4)

    config, reason = resolve_engines(job(), 4096, SMALL, gpus=False, nodes=TWO_CORES)
    compute = config.compute
    assert (compute.num_actors, compute.engines_per_actor, compute.num_engines) == (1, 2, 2)
    assert "2 engines in each of 1 actor process(es)" in reason
    # the actor holds both engines' CPUs for Ray's scheduling: a whole CPU is left
    assert compute.actor_cpus == 0.75
    several = [Node(16.0, 64 * GiB)] * 2
    config, _ = resolve_engines(job(), 4096, SMALL, gpus=False, nodes=several)
    assert (config.compute.num_actors, config.compute.engines_per_actor) == (16, 1)
    # given counts keep one engine per actor unless asked
    config, _ = resolve_engines(job(num_actors=2), 4096, SMALL, gpus=False, nodes=TWO_CORES)
    assert (config.compute.num_actors, config.compute.engines_per_actor) == (2, 1)
    config, _ = resolve_engines(
        job(num_actors=1, engines_per_actor=2), 4096, SMALL, gpus=False, nodes=TWO_CORES
    )
    assert (config.compute.num_engines, config.compute.actor_cpus) == (2, 0.75)


def test_each_engine_of_an_actor_gets_its_share_of_the_threads(monkeypatch) -> None:
    import pipeline.stages.engine_actor as engine_actor

    monkeypatch.setattr(engine_actor, "available_cpus", lambda: 8.0)
    monkeypatch.setattr(engine_actor, "largest_node_cpus", lambda: 8.0)
    args = {"num_gpus": 0}
    assert default_torch_threads(ComputeConfig(num_actors=1, engines_per_actor=2), args) == 4
    assert default_torch_threads(ComputeConfig(num_actors=2, engines_per_actor=2), args) == 2
    assert default_torch_threads(ComputeConfig(num_actors=1), args) == 8


def test_several_engines_per_actor_are_for_cpu_engines_only() -> None:
    with pytest.raises(ValueError, match="several engines share an actor on CPU only"):
        engine_actor_args(ComputeConfig(num_actors=1, engines_per_actor=2, num_gpus_per_actor=1))
    for bad in (0, -1, "two", 1.5):
        with pytest.raises(ValueError, match="engines_per_actor must be an integer >= 1"):
            ComputeConfig(engines_per_actor=bad)
