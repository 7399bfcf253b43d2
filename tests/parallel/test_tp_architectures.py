"""Tensor parallel over the test matrix (tests/model_matrix.py): the model types in
`actors.architectures.PARALLEL_MODEL_TYPES` give the single-process engine's greedy tokens at
tp=2; every other one is refused when the engine is built, before any worker starts, with a
message naming why (never a wrong token: gemma and gemma2 were, before the gate, since the
parallel stages skip their embedding scale and final softcapping)."""

from __future__ import annotations

import pytest

from actors import EngineConfig, LLMEngine
from actors.architectures import PARALLEL_MODEL_TYPES, UnsupportedModelError
from tests.model_matrix import MATRIX, save_matrix_model
from tests.parallel.conftest import assert_same_tokens, engine_config, run_engine

PARALLEL = [name for name, (kind, _) in MATRIX.items() if kind in PARALLEL_MODEL_TYPES]
REFUSED = [name for name in MATRIX if name not in PARALLEL]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", PARALLEL)
def test_tp2_matches_tp1(ray_local, tmp_path, prompts_and_groups, name) -> None:  # noqa: ANN001
    prompts, groups = prompts_and_groups
    folder = save_matrix_model(tmp_path / name, name)
    expected = run_engine(engine_config(folder, shared_prefix_attention=False), prompts, groups)
    got = run_engine(engine_config(folder, tensor_parallel_size=2), prompts, groups)
    assert_same_tokens(folder, prompts, got, expected)


@pytest.mark.parametrize("name", REFUSED)
def test_other_architectures_are_refused_before_any_worker(tmp_path, name) -> None:  # noqa: ANN001
    folder = save_matrix_model(tmp_path / name, name)
    config = EngineConfig(model=str(folder), tensor_parallel_size=2, num_kv_blocks=16)
    with pytest.raises(ValueError) as info:  # no Ray: refused while the skeleton is checked
        LLMEngine(config)
    message = str(info.value)
    if isinstance(info.value, UnsupportedModelError):
        assert "tensor/pipeline parallel" in message and MATRIX[name][0] in message
    else:  # the sharding's own check of the layout (gpt2, gpt_neox)
        assert "not a Llama-style decoder" in message
