"""The test matrix: a tiny random model of every architecture the engine runs
(tests/model_matrix.py), saved with `save_pretrained` and loaded by folder as a user's model,
gives Hugging Face `generate`'s greedy tokens on each prompt alone through the packed path,
the prefix cache with prefix groups, and chunked prefill with prefix groups. The matrix is
`actors.architectures.TESTED_MODEL_TYPES`, which docs/models.md lists (tests/test_models_doc.py).
"""

from __future__ import annotations

import pytest

from actors import EngineConfig, LLMEngine, SamplingParams
from actors.architectures import TESTED_MODEL_TYPES
from tests.actors.groups import prefix_groups_for, shared_prefix_prompts
from tests.actors.reference import assert_greedy_match, hf_greedy
from tests.model_matrix import MATRIX, matrix_model, save_matrix_model

MAX_TOKENS = 8


def test_the_matrix_is_the_registry() -> None:
    assert {model_type for model_type, _ in MATRIX.values()} == set(TESTED_MODEL_TYPES)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:  # noqa: ANN001
    return [tokenizer.encode(p, add_special_tokens=False) for p in shared_prefix_prompts()]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(MATRIX))
def test_architecture_matches_hf_generate_on_every_path(name, tmp_path, prompt_ids) -> None:  # noqa: ANN001
    folder = save_matrix_model(tmp_path / name, name)
    reference = matrix_model(name)  # the saved weights, left on transformers' own attention
    expected = [hf_greedy(reference, ids, MAX_TOKENS) for ids in prompt_ids]
    groups = prefix_groups_for(prompt_ids)
    params = SamplingParams(max_tokens=MAX_TOKENS)

    # float32 pinned: the promise is float32's (a CPU with native bfloat16 may default to it)
    packed = LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=256, dtype="float32"))
    runs = {"packed": packed.generate(prompt_ids, params)}
    # the same prompts again: their full blocks come from the prefix cache, groups share too
    runs["prefix cache + groups"] = packed.generate(prompt_ids, params, groups)
    assert all(out.num_cached_tokens > 0 for out in runs["prefix cache + groups"][:5])
    chunked = LLMEngine(
        EngineConfig(
            model=str(folder),
            dtype="float32",
            num_kv_blocks=256,
            chunk_size=7,
            max_num_batched_tokens=64,
            enable_prefix_caching=False,
        )
    )
    runs["chunked + groups"] = chunked.generate(prompt_ids, params, groups)
    for path, outputs in runs.items():
        for ids, out, exp in zip(prompt_ids, outputs, expected, strict=True):
            assert out.finished and out.error is None, (name, path, out.error)
            try:
                assert_greedy_match(reference, ids, out.token_ids, exp)
            except AssertionError as exc:
                raise AssertionError(f"{name}, {path}: {exc}") from exc
