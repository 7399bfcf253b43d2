"""The shared engine flags: vLLM's names in, the EngineConfig they describe out."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from actors.config import EngineConfig
from pipeline.engine_flags import add_engine_flags, engine_config_from_args


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    return parser.parse_args(list(argv))


def test_defaults_are_the_engine_config_defaults() -> None:
    assert engine_config_from_args(_parse()) == EngineConfig(kv_cache_memory_gb=1.0)
    assert engine_config_from_args(_parse()) == EngineConfig()  # one default, in EngineConfig


def test_parallel_and_engine_flags() -> None:
    args = _parse(
        *("--model", "/m", "-tp", "2", "--pipeline-parallel-size", "3"),
        *("--placement-strategy", "SPREAD", "--worker-num-cpus", "0.25", "--chunk-size", "7"),
        *("--max-num-batched-tokens", "48", "--no-prefix-caching", "--dtype", "bfloat16"),
        "--no-shared-prefix-attention",
        "--no-fused-layers",
        *("--lm-head-screen", "off"),
    )
    config = engine_config_from_args(args, seed=5)
    assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (2, 3)
    assert config.world_size == 6 and config.placement_strategy == "SPREAD"
    assert (config.worker_num_cpus, config.chunk_size, config.max_num_batched_tokens) == (
        0.25,
        7,
        48,
    )
    assert not config.enable_prefix_caching and config.dtype == "bfloat16"
    assert (
        config.shared_prefix_attention is False and EngineConfig().shared_prefix_attention is None
    )
    assert not config.fused_layers and EngineConfig().fused_layers
    assert config.lm_head_screen == "off" and EngineConfig().lm_head_screen == "auto"
    assert config.model == "/m" and config.seed == 5


def test_a_bad_value_names_the_field() -> None:
    with pytest.raises(ValueError, match="lm_head_screen"):
        EngineConfig(lm_head_screen="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        engine_config_from_args(_parse("-tp", "0"))


def test_a_parser_with_fewer_flags_keeps_the_defaults() -> None:
    config = engine_config_from_args(argparse.Namespace(model="/m", max_num_seqs=8))
    assert config == EngineConfig(model="/m", max_num_seqs=8)


def test_tpot_target_turns_on_the_step_budget_controller() -> None:
    config = engine_config_from_args(
        _parse("--tpot-target-ms", "250", "--max-num-batched-tokens", "256")
    )
    assert config.tpot_target_s == 0.25
    budget = config.step_budget_config()
    assert budget is not None and budget.ceiling == 256 and budget.tpot_target_s == 0.25
    assert engine_config_from_args(_parse()).step_budget_config() is None  # fixed by default
    with pytest.raises(ValueError, match="tpot_target_s"):
        engine_config_from_args(_parse("--tpot-target-ms", "-1"))


def test_serve_app_arguments_take_the_tpot_target() -> None:
    from pipeline.serve.cli import serve_config_from_app_args

    config = serve_config_from_app_args({"model": "smollm2", "tpot_target_ms": "200"})
    assert config.engine.tpot_target_s == 0.2


def test_a_job_resolves_auto_once_for_all_its_engines(ray_cluster, tmp_path) -> None:
    """The driver picks one dtype for every engine actor (no GPU in this cluster: the CPU's)."""
    from actors.dtypes import choose_dtype, cpu_info
    from pipeline.config import InputConfig, JobConfig, PromptConfig
    from pipeline.job.run import _resolved_dtype

    config = JobConfig(
        input=InputConfig("in.parquet"),
        prompt=PromptConfig(prompt_column="prompt"),
        output=str(tmp_path / "out"),
        engine=EngineConfig(model="/m"),
    )
    resolved = _resolved_dtype(config)
    assert resolved.engine.dtype == choose_dtype("auto", "cpu", cpu_info())[0]
    pinned = replace(config, engine=EngineConfig(model="/m", dtype="float32"))
    assert _resolved_dtype(pinned) is pinned
