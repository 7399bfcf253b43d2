"""Clear errors at start: shapes tp x pp cannot split, placement groups that cannot be placed;
the tensor-parallel shard arithmetic."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from actors import EngineConfig, LLMEngine
from actors.parallel import placement
from actors.parallel.pp import layer_range
from actors.parallel.tp import shard_slice, tp_shape
from tests.parallel.conftest import engine_config, save_context_model
from tests.tiny_models import tiny_config


def test_config_validates_parallel_sizes() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="placement_strategy"):
        EngineConfig(placement_strategy="ANYWHERE")  # type: ignore[arg-type]
    assert EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=3).world_size == 6


def test_heads_not_divisible_is_a_clear_error_at_start(tmp_path) -> None:
    folder = save_context_model(tmp_path / "qwen2", "qwen2")  # 3 heads, 1 KV head
    with pytest.raises(ValueError, match="3 attention heads are not divisible by 2"):
        LLMEngine(engine_config(folder, tensor_parallel_size=2))
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        LLMEngine(engine_config(folder, pipeline_parallel_size=3))


def test_tp_shape_shards_heads_and_replicates_kv_heads() -> None:
    llama = tiny_config("llama")  # 4 heads, 2 KV heads, head_dim 16, intermediate 128
    two = [tp_shape(llama, r, 2) for r in range(2)]
    assert [s.rows("q_proj") for s in two] == [(0, 32), (32, 64)]
    assert [s.rows("k_proj") for s in two] == [(0, 16), (16, 32)]
    assert [s.rows("down_proj") for s in two] == [(0, 64), (64, 128)]
    four = [tp_shape(llama, r, 4) for r in range(4)]
    # Query heads 0,1 use KV head 0 and heads 2,3 use KV head 1: each KV head on two ranks.
    assert [s.rows("k_proj") for s in four] == [(0, 16), (0, 16), (16, 32), (16, 32)]
    assert [s.local_kv_heads for s in four] == [1, 1, 1, 1]
    assert shard_slice("model.layers.0.self_attn.q_proj.weight", two[1]) == (0, 32, 64)
    assert shard_slice("model.layers.0.self_attn.o_proj.weight", two[1]) == (1, 32, 64)
    assert shard_slice("model.layers.0.self_attn.o_proj.bias", two[1]) is None
    assert shard_slice("model.layers.0.input_layernorm.weight", two[1]) is None
    with pytest.raises(ValueError, match="multiple of the 2 KV heads"):
        tp_shape(SimpleNamespace(**{**llama.to_dict(), "num_attention_heads": 6}), 0, 3)


def test_layer_ranges_cover_the_model_contiguously() -> None:
    assert [layer_range(5, 2, s) for s in range(2)] == [(0, 3), (3, 5)]
    assert [layer_range(4, 4, s) for s in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_infeasible_bundles_are_named() -> None:
    nodes = [{"CPU": 2.0}, {"CPU": 2.0}]
    assert placement.infeasible([{"CPU": 1.5}] * 2, "PACK", nodes) is None
    assert "STRICT_PACK needs {'CPU': 3.0}" in str(
        placement.infeasible([{"CPU": 1.5}] * 2, "STRICT_PACK", nodes)
    )
    assert "fits no single node" in str(placement.infeasible([{"GPU": 1.0}], "PACK", nodes))
    assert "needs 3 nodes" in str(placement.infeasible([{"CPU": 1.0}] * 3, "STRICT_SPREAD", nodes))


@pytest.mark.timeout(120)
def test_unplaceable_groups_fail_fast_with_a_clear_message(ray_local, llama_dir) -> None:
    from ray.util.placement_group import placement_group_table

    groups_before = set(placement_group_table())
    with pytest.raises(ValueError, match=r"can never be placed: .*STRICT_PACK needs \{'CPU': 3"):
        LLMEngine(engine_config(llama_dir, tensor_parallel_size=2, worker_num_cpus=1.5))
    # fast = refused before any reservation is tried (nothing waits for a placement timeout)
    assert set(placement_group_table()) == groups_before
    held = placement.reserve([{"CPU": 1.5}], "PACK", timeout_s=10)  # leaves 0.5 CPU free
    try:
        with pytest.raises(TimeoutError, match=r"not placed within 2 s.*free"):
            placement.reserve([{"CPU": 1.0}], "PACK", timeout_s=2)
    finally:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(held)


@pytest.mark.timeout(120)
def test_worker_device_comes_from_the_cluster_not_the_engine_actor(ray_local) -> None:
    # The engine actor of a tp x pp engine holds no GPU; its workers' device is the
    # cluster's (CPU here), or what the config names.
    assert placement.worker_device(EngineConfig(tensor_parallel_size=2)) == "cpu"
    assert placement.worker_device(EngineConfig(device="cuda:0")) == "cuda:0"
