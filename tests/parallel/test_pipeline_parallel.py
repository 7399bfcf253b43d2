"""tp=2 x pp=2 through a Ray compiled graph gives the single-process engine's greedy tokens with
two steps in flight, and fails loudly when a stage dies; the same layout through one Ray task
per worker per step (the CPU default) is test_pipeline_faults.py's engine."""

from __future__ import annotations

import pytest
import ray

from tests.parallel.conftest import (
    MAX_TOKENS,
    assert_killed_worker_fails_loudly,
    assert_same_tokens,
    engine_config,
    run_engine,
)


@pytest.fixture(scope="module")
def expected(llama_dir, prompts_and_groups):
    prompts, groups = prompts_and_groups
    return run_engine(engine_config(llama_dir), prompts, groups)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_pipelined_engine_keeps_two_steps_in_flight_then_fails_loudly(
    ray_local, llama_dir, prompts_and_groups, expected
):
    """tp=2 x pp=2 through a compiled graph as the engine's executor: the engine's two request
    sets have steps in flight together and the tokens are the single-process engine's; then,
    through the graph too, a stage that dies mid-step is a WorkerFailedError that names it
    and the step, the engine refuses further steps, and the group is released. One engine
    group for all of it (each worker is a process importing torch): the tp2xpp2 compiled
    engine that only compared tokens is this one."""
    from actors import LLMEngine, SamplingParams
    from actors.parallel.compiled import CompiledSteps
    from actors.parallel.pipelined import bubble_fraction

    prompts, groups = prompts_and_groups
    config = engine_config(llama_dir, tensor_parallel_size=2, pipeline_parallel_size=2)
    engine = LLMEngine(config, compiled_graph=True)
    try:
        assert isinstance(engine.runner, CompiledSteps) and engine.runner.max_in_flight == 2
        assert len(engine.scheduler.schedulers) == 2
        depths = []
        fill = engine._fill

        def record(outputs):
            fill(outputs)
            depths.append(len(engine._in_flight))

        engine._fill = record  # type: ignore[method-assign]
        outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), groups)
        engine._fill = fill  # type: ignore[method-assign]
        assert all(o.finished and o.error is None for o in outputs)
        assert_same_tokens(llama_dir, prompts, [o.token_ids for o in outputs], expected)
        assert max(depths) == 2
        assert not engine.scheduler._owner  # every request (and group) released its set
        assert engine.scheduler._owed == [0, 0] and not engine.scheduler._weight
        timings = engine.runner.take_timings()
        assert len(timings) == 2 and all(timings)
        assert [step for step, _, _ in timings[0]] == [step for step, _, _ in timings[1]]
        assert 0.0 <= bubble_fraction(timings) < 1.0
        assert_killed_worker_fails_loudly(engine, 1, 0, prompts, groups)
    finally:
        engine.runner.shutdown()
    assert all(s["state"] == "REMOVED" for s in ray.util.placement_group_table().values())


def test_bubble_fraction_counts_idle_stage_time() -> None:
    """Two stages over a 10 s span, busy 10 s and 5 s: a quarter of their time is idle."""
    from actors.parallel.pipelined import bubble_fraction

    stage0 = [(1, 0.0, 5.0), (2, 5.0, 10.0)]
    stage1 = [(1, 5.0, 7.0), (2, 7.0, 10.0)]
    assert bubble_fraction([stage0, stage1]) == pytest.approx(0.25)
    assert bubble_fraction([stage0, [(1, 0.0, 10.0)]]) == 0.0
    assert bubble_fraction([[], []]) == 0.0


def test_sets_balance_tokens_not_request_counts() -> None:
    """One long prompt and ten short ones: the short ones all join the other set (by count
    each set would get half, and the long one's set would run on alone at the end); every
    request that finishes gives its tokens back."""
    from actors import EngineConfig, SamplingParams
    from actors.request import Request
    from actors.virtual_schedulers import VirtualSchedulers

    sets = VirtualSchedulers(EngineConfig(dtype="float32"), blocks_per_set=64, count=2)
    params = SamplingParams(max_tokens=1)
    long = Request("long", list(range(100)), params)
    short = [Request(f"s{i}", list(range(10)), params) for i in range(10)]
    for req in [long, *short]:
        sets.add(req)
    assert sets.owner(long) == 0 and {sets.owner(r) for r in short} == {1}
    assert sets._owed == [101, 110]
    sets.finish([long, *short[:4]], "abort")
    assert sets._owed == [0, 66]
    sets.add(Request("next", list(range(10)), params))  # now the emptier set
    assert sets.owner(sets.schedulers[0].waiting[0]) == 0
    sets.finish(short[4:] + [sets.schedulers[0].waiting[0]], "abort")
    assert sets._owed == [0, 0] and not sets._owner and not sets._weight
