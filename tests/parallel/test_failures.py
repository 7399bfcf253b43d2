"""A worker that dies mid-step makes the engine fail loudly (a clear error, no hang). Each
engine first answers as the single-process engine does (tp=2 without shared-prefix decode
attention: test_parallel_architectures.py runs it with; pp=2 through one Ray task per worker
per step), then one of its workers is killed: one engine group for both checks."""

from __future__ import annotations

import pytest

from actors import LLMEngine, SamplingParams
from tests.parallel.conftest import (
    MAX_TOKENS,
    assert_killed_worker_fails_loudly,
    assert_same_tokens,
    engine_config,
    run_engine,
)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "tp,pp,stage,rank,shared_prefix",
    [(2, 1, 0, 1, False), (1, 2, 1, 0, True)],
    ids=["tp-plain", "pp"],
)
def test_engine_matches_one_process_then_a_killed_worker_fails_loudly(
    ray_local, llama_dir, prompts_and_groups, tp, pp, stage, rank, shared_prefix
) -> None:
    prompts, groups = prompts_and_groups
    expected = run_engine(engine_config(llama_dir, shared_prefix_attention=False), prompts, groups)
    config = engine_config(
        llama_dir,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        shared_prefix_attention=shared_prefix,
    )
    engine = LLMEngine(config)  # on CPU: one Ray task per worker per step
    try:
        outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), groups)
        assert all(o.finished and o.error is None for o in outputs)
        assert_same_tokens(llama_dir, prompts, [o.token_ids for o in outputs], expected)
        assert_killed_worker_fails_loudly(engine, stage, rank, prompts, groups)
    finally:
        engine.runner.shutdown()
