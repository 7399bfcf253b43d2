"""Tensor parallel (tp=2, gloo on CPU) gives the single-process engine's greedy tokens, with
shared-prefix decode attention (each worker's share of the heads) on and off."""

from __future__ import annotations

import pytest

from tests.parallel.conftest import assert_same_tokens, engine_config, run_engine


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("shared_prefix", [True, False], ids=["shared-prefix", "plain"])
def test_tp2_matches_tp1(ray_local, llama_dir, prompts_and_groups, shared_prefix) -> None:
    prompts, groups = prompts_and_groups
    expected = run_engine(engine_config(llama_dir, shared_prefix_attention=False), prompts, groups)
    config = engine_config(llama_dir, tensor_parallel_size=2, shared_prefix_attention=shared_prefix)
    got = run_engine(config, prompts, groups)
    assert_same_tokens(llama_dir, prompts, got, expected)
