"""`--num-actors auto` (pipeline/job/engine_count.py): how many engine actors a job starts,
from the nodes' CPUs and memory, the model and the rows; no Ray needed (nodes are given)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.config import (
    ComputeConfig,
    EngineConfig,
    InputConfig,
    JobConfig,
    PlanConfig,
    PromptConfig,
)
from pipeline.job.engine_count import (
    RUNTIME_BYTES,
    Node,
    cpu_engines,
    cpus_per_actor,
    engine_bytes,
    resolve_engines,
)
from pipeline.job.engine_placement import check_cpu_room
from pipeline.job.run import BYTES_PER_PARTITION, partitions_for
from pipeline.stages.engine_actor import shards_in_flight

GiB = 2**30
TWO_CORES = [Node(cpus=2.0, memory=16 * GiB)]
SMALL = LlamaConfig(
    vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
)  # fmt: skip


def job(**compute) -> JobConfig:
    return JobConfig(
        input=InputConfig(path="in.parquet"),
        prompt=PromptConfig(prompt_column="p"),
        output="out",
        engine=EngineConfig(dtype="float32"),
        compute=ComputeConfig(**compute),
    )


def test_engine_bytes_count_the_weights_of_the_model() -> None:
    torch.manual_seed(0)
    params = sum(p.numel() for p in LlamaForCausalLM(SMALL).parameters())
    norms = SMALL.hidden_size * (2 * SMALL.num_hidden_layers + 1)  # not counted: tiny
    counted = engine_bytes(SMALL, 4, kv_cache_gb=0.5) - 0.5 * GiB - RUNTIME_BYTES
    assert counted == (params - norms) * 4
    assert engine_bytes(object(), 4, 1.0) is None  # a config without shapes: no memory cap


def test_one_engine_per_core_where_the_rows_pay_for_it() -> None:
    assert cpu_engines(TWO_CORES, 1, 3 * GiB, None)[0] == 2  # rows unknown: the cores
    assert cpu_engines(TWO_CORES, 1, 3 * GiB, 525)[0] == 2
    count, reason = cpu_engines(TWO_CORES, 1, 3 * GiB, 300)  # < 256 sequences each
    assert count == 1 and "300 sequences are worth 1" in reason
    assert cpu_engines(TWO_CORES, 2, 3 * GiB, 10_000)[0] == 1  # two threads each
    assert cpu_engines([Node(16.0, 64 * GiB)] * 2, 1, None, None)[0] == 32


def test_memory_caps_the_engines_per_node() -> None:
    # half of 64 GiB holds 5 engines of 6 GiB, though the node has 16 cores
    assert cpu_engines([Node(16.0, 64 * GiB)], 1, 6 * GiB, None)[0] == 5
    assert cpu_engines([Node(16.0, 4 * GiB)], 1, 6 * GiB, None)[0] == 1  # at least one


def test_auto_engines_leave_a_whole_cpu_for_ray_data() -> None:
    config, reason = resolve_engines(job(), 4096, SMALL, gpus=False, nodes=TWO_CORES)
    assert config.compute.num_engines == 2 and reason
    assert cpus_per_actor(TWO_CORES, 2, 0.25) == 0.375  # each engine's; a pair's actor 0.75
    assert config.compute.num_cpus_per_actor == 0.75  # (test_engines_per_actor.py)
    check_cpu_room(config, False, [{"CPU": 2.0}])  # would raise NoRoomError at 0.5 each
    apart = job(engines_per_actor=1)  # two actors of one engine
    config, _ = resolve_engines(apart, 4096, SMALL, gpus=False, nodes=TWO_CORES)
    assert (config.compute.num_actors, config.compute.num_cpus_per_actor) == (2, 0.375)
    check_cpu_room(config, False, [{"CPU": 2.0}])
    roomy = [Node(16.0, 64 * GiB)] * 2
    assert cpus_per_actor(roomy, 8, 0.25) == 0.5


def test_given_counts_and_device_bound_engines_are_kept() -> None:
    config, reason = resolve_engines(job(num_actors=2), 4096, SMALL, gpus=False, nodes=TWO_CORES)
    assert (config.compute.num_actors, reason, config.compute.actor_cpus) == (2, None, 0.375)
    config, reason = resolve_engines(job(num_actors=1), 4096, SMALL, gpus=False, nodes=TWO_CORES)
    assert (config.compute.num_actors, reason, config.compute.actor_cpus) == (1, None, 0.5)
    for gpus, compute in [(True, {}), (False, {"resources": (("fake_gpu", 1.0),)})]:
        config, reason = resolve_engines(job(**compute), 4096, SMALL, gpus, nodes=TWO_CORES)
        assert config.compute.num_actors == 1 and "one engine" in reason
    given = job(num_cpus_per_actor=0.1)
    assert resolve_engines(given, 4096, SMALL, False, TWO_CORES)[0].compute.actor_cpus == 0.1


@pytest.mark.parametrize("bad", [0, -1, "two", 1.5])
def test_a_bad_count_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="num_actors must be an integer >= 1 or 'auto'"):
        ComputeConfig(num_actors=bad)


def test_the_flag_takes_auto_or_a_count_and_names_itself(tmp_path: Path, capsys) -> None:
    spec = importlib.util.spec_from_file_location(
        "generate", Path(__file__).resolve().parents[2] / "jobs" / "generate.py"
    )
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    args = ["--input", "in.parquet", "--output", str(tmp_path / "out"), "--prompt-column", "p"]
    with pytest.raises(SystemExit) as exited:
        generate.main([*args, "--num-actors", "0"])
    assert exited.value.code == 2
    assert "--num-actors: wants an integer >= 1 or auto, got '0'" in capsys.readouterr().err


def test_each_engine_holds_at_most_its_share_of_the_shards() -> None:
    engine, plan = EngineConfig(max_num_seqs=256), PlanConfig(max_rows_per_shard=64)
    assert shards_in_flight(engine, plan) == 9  # twice the batch in rows, plus one shard
    assert shards_in_flight(engine, plan, rows_per_actor=512) == 8  # 1,024 rows, 2 engines
    assert shards_in_flight(engine, plan, rows_per_actor=1000) == 9
    assert shards_in_flight(engine, plan, rows_per_actor=64) == 1  # 128 rows, 2 engines


def test_partitions_follow_the_input_bytes_not_the_engines() -> None:
    assert partitions_for(10) == 1
    assert partitions_for(2 * BYTES_PER_PARTITION + 1) == 3


@pytest.mark.timeout(120)
def test_the_jobs_dataset_runs_without_ray_datas_reservations(
    ray_cluster, prompt_table, tiny_model_dir, tmp_path
) -> None:
    """They held the shuffle's second partition from the plan until the engine had done the
    first (docs/benchmarks-job-engine.md); the job's own dataset and the processor's turn
    them off, the driver's and a user's datasets keep them."""
    import ray.data

    from pipeline.job.run import build_dataset, prepare
    from tests.pipeline.test_job import make_config

    config = make_config(prompt_table, tiny_model_dir, tmp_path / "out")
    user = ray.data.range(4)
    ds = build_dataset(config, prepare(config))  # lazy: nothing runs
    assert ds.context.op_resource_reservation_enabled is False
    assert ray.data.DataContext.get_current().op_resource_reservation_enabled is True
    assert user.context.op_resource_reservation_enabled is True
    # The processor's dataset too, on a context of its own: the user's input keeps theirs.
    from pipeline import ProcessorConfig, build_processor

    out = build_processor(ProcessorConfig(prompt_column="p", concurrency=2))(
        user.map(lambda row: {"p": str(row["id"])})
    )
    assert out.context.op_resource_reservation_enabled is False
    assert out.context is not user.context
    assert user.context.op_resource_reservation_enabled is True
    assert ray.data.DataContext.get_current().op_resource_reservation_enabled is True


def test_one_writer_per_eight_engine_actors_unless_given() -> None:
    from pipeline.io.writer import default_num_writers

    assert [default_num_writers(n) for n in (1, 2, 8, 9, 64)] == [1, 1, 1, 2, 8]
