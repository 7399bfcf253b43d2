"""Tensor parallel (tp=2, gloo on CPU) gives the single-process engine's greedy tokens."""

from __future__ import annotations

import pytest

from tests.parallel.conftest import assert_same_tokens, engine_config, run_engine


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tp2_matches_tp1(ray_local, llama_dir, prompts_and_groups) -> None:
    prompts, groups = prompts_and_groups
    expected = run_engine(engine_config(llama_dir), prompts, groups)
    got = run_engine(engine_config(llama_dir, tensor_parallel_size=2), prompts, groups)
    assert_same_tokens(llama_dir, prompts, got, expected)
