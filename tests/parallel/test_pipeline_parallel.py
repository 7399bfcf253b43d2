"""Pipeline parallel (pp=2) and tp=2 x pp=2 give the single-process engine's greedy tokens."""

from __future__ import annotations

import pytest

from tests.parallel.conftest import assert_same_tokens, engine_config, run_engine


@pytest.fixture(scope="module")
def expected(llama_dir, prompts_and_groups):
    prompts, groups = prompts_and_groups
    return run_engine(engine_config(llama_dir), prompts, groups)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2)], ids=["pp2", "tp2xpp2"])
def test_pipeline_matches_single_process(
    ray_local, llama_dir, prompts_and_groups, expected, tp, pp
) -> None:
    prompts, groups = prompts_and_groups
    config = engine_config(llama_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    got = run_engine(config, prompts, groups)
    assert_same_tokens(llama_dir, prompts, got, expected)
