"""A worker that dies mid-step makes the engine fail loudly (a clear error, no hang). The tp=2
engine first answers as the single-process engine does, then one of its workers is killed:
one engine group for both checks. It runs without shared-prefix decode attention
(test_engine_in_group.py's tp=2 engine runs with it) on the dynamic-NTK llama with short and
long prompts packed together, so it is also the check that each token's rope length travels
in the step plan to the tp ranks (the rope check test_rope_parallel.py[llama-tp2] made on an
engine of its own). tp=2 x pp=2 engines lose a stage in test_pipeline_faults.py (Ray tasks)
and test_pipeline_parallel.py (a compiled graph)."""

from __future__ import annotations

import pytest

from actors import LLMEngine, SamplingParams
from tests.actors.rope_models import prompts as rope_prompts
from tests.parallel.conftest import (
    MAX_TOKENS,
    assert_killed_worker_fails_loudly,
    engine_config,
    run_engine,
)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tp_engine_matches_one_process_then_a_killed_worker_fails_loudly(
    ray_local, rope_dirs
) -> None:
    rope_dir = rope_dirs["llama"]
    batch = rope_prompts([20, 60, 100], seed=13)
    settings = dict(chunk_size=16, shared_prefix_attention=False)
    expected = run_engine(engine_config(rope_dir, **settings), batch, ())
    engine = LLMEngine(engine_config(rope_dir, tensor_parallel_size=2, **settings))
    try:  # on CPU: one Ray task per worker per step
        outputs = engine.generate(batch, SamplingParams(max_tokens=MAX_TOKENS))
        assert all(o.finished and o.error is None for o in outputs)
        assert [o.token_ids for o in outputs] == expected
        assert_killed_worker_fails_loudly(engine, 0, 1, batch, ())
    finally:
        engine.runner.shutdown()
