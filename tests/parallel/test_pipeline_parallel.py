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


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_pipelined_engine_keeps_two_steps_in_flight(ray_local, llama_dir, prompts_and_groups):
    """pp=2 builds a PipelinedEngine whose two request sets have steps in flight together."""
    from actors import LLMEngine, SamplingParams
    from actors.parallel.pipelined import PipelinedEngine, bubble_fraction

    prompts, groups = prompts_and_groups
    engine = LLMEngine(engine_config(llama_dir, pipeline_parallel_size=2))
    try:
        assert isinstance(engine, PipelinedEngine)
        depths = []
        fill = engine._fill

        def record(outputs):
            fill(outputs)
            depths.append(len(engine._in_flight))

        engine._fill = record  # type: ignore[method-assign]
        outputs = engine.generate(prompts, SamplingParams(max_tokens=4), groups)
        assert all(o.finished and o.error is None for o in outputs)
        assert max(depths) == 2
        assert not engine.sets._owner  # every request (and group) released its set
        timings = engine.executor.take_timings()
        assert len(timings) == 2 and all(timings)
        assert 0.0 <= bubble_fraction(timings) < 1.0
    finally:
        engine.executor.shutdown()
