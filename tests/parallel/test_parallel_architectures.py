"""Tensor and pipeline parallel over the test matrix (tests/model_matrix.py): the model types
in `actors.architectures.TENSOR_PARALLEL_MODEL_TYPES` give the single-process engine's greedy
tokens at tp=2, those in `PIPELINE_PARALLEL_MODEL_TYPES` at pp=2; every other one is refused
when the engine is built, before any worker starts, with a message naming why. Never a wrong
token: before the gate gemma and gemma2 were wrong at tp=2 and pp=2 (the parallel stages skip
their embedding scale and final softcapping)."""

from __future__ import annotations

import pytest

from actors import EngineConfig, LLMEngine
from actors.architectures import (
    PIPELINE_PARALLEL_MODEL_TYPES,
    TENSOR_PARALLEL_MODEL_TYPES,
    UnsupportedModelError,
)
from tests.model_matrix import MATRIX, save_matrix_model
from tests.parallel.conftest import assert_same_tokens, engine_config, run_engine

SIZES = {"tp": ("tensor_parallel_size", TENSOR_PARALLEL_MODEL_TYPES),
         "pp": ("pipeline_parallel_size", PIPELINE_PARALLEL_MODEL_TYPES)}  # fmt: skip
RUNS = [(k, n) for k, (_, kinds) in SIZES.items() for n, (t, _) in MATRIX.items() if t in kinds]
# pp runs of what tp already ran add little: pp only for the types tp refuses
RUNS = [(k, n) for k, n in RUNS if k == "tp" or MATRIX[n][0] not in TENSOR_PARALLEL_MODEL_TYPES]
# The rope variants of a type (llama3_rope, qwen2_yarn) take the same parallel path as the
# type: the stage's rotary rebuilt from the model's config and rope parameters
# (actors/parallel/weights.py), run with a scaled rope by test_rope_parallel.py (dynamic
# llama at tp=2 and pp=2, longrope phi3 at pp=2); their rope math is the single-process
# engine's (tests/actors/test_architectures.py), which these runs compare against.
RUNS = [(k, n) for k, n in RUNS if "rope_parameters" not in MATRIX[n][1]]
# Two runs are engines other tests start anyway (each run here is one more group of two worker
# processes importing torch): llama at tp=2 with prefix groups and shared-prefix attention is
# test_engine_in_group.py's engine (the context llama: 2 KV heads, as the matrix's), and phi3's
# layers at pp=2 are test_rope_parallel.py's (the longrope phi3; plain rope at pp=2 runs in
# olmo2's case here, shared-prefix attention at pp=2 in olmo2's and the tp2xpp2 engines').
# mistral (the matrix's has no sliding window) builds llama's layers at tp=2: the same
# projections, no biases, no extra norms; its run here added 10-11 s of the suite's time.
ELSEWHERE = [("tp", "llama"), ("pp", "phi3"), ("tp", "mistral")]
RUNS = [run for run in RUNS if run not in ELSEWHERE]
REFUSED = [
    (k, n) for k, (_, kinds) in SIZES.items() for n, (t, _) in MATRIX.items() if t not in kinds
]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kind", "name"), RUNS)
def test_parallel_matches_one_process(ray_local, tmp_path, prompts_and_groups, kind, name) -> None:  # noqa: ANN001
    prompts, groups = prompts_and_groups
    folder = save_matrix_model(tmp_path / name, name)
    expected = run_engine(engine_config(folder, shared_prefix_attention=False), prompts, groups)
    got = run_engine(engine_config(folder, **{SIZES[kind][0]: 2}), prompts, groups)
    assert_same_tokens(folder, prompts, got, expected)


@pytest.mark.parametrize(("kind", "name"), REFUSED)
def test_other_architectures_are_refused_before_any_worker(tmp_path, kind, name) -> None:  # noqa: ANN001
    folder = save_matrix_model(tmp_path / name, name)
    config = EngineConfig(model=str(folder), num_kv_blocks=16, **{SIZES[kind][0]: 2})
    with pytest.raises(ValueError) as info:  # no Ray: refused while the skeleton is checked
        LLMEngine(config)
    message = str(info.value)
    if isinstance(info.value, UnsupportedModelError):
        parallel = SIZES[kind][0].split("_")[0]  # tensor or pipeline
        assert f"{MATRIX[name][0]!r} is not supported with {parallel} parallel" in message
    else:  # the parallel stages' own check of the layout (gpt2, gpt_neox)
        assert "not a Llama-style decoder" in message
