"""A worker that dies mid-step makes the engine fail loudly (a clear error, no hang)."""

from __future__ import annotations

import pytest
import ray

from actors import LLMEngine, SamplingParams
from actors.parallel.executor import WorkerFailedError
from tests.parallel.conftest import engine_config


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp,pp,stage,rank", [(2, 1, 0, 1), (1, 2, 1, 0)], ids=["tp", "pp"])
def test_worker_killed_mid_step_fails_loudly(
    ray_local, llama_dir, prompts_and_groups, tp, pp, stage, rank
) -> None:
    prompts, groups = prompts_and_groups
    engine = LLMEngine(engine_config(llama_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp))
    executor = engine.runner
    ray.get(executor.workers[stage][rank].crash_at_step.remote(3))
    # No hang: the test's timeout is the guard (no wall-clock bound asserted). The worker exits
    # in step 3; with pp, step 2's reply may still be unsent when it does (os._exit drops it),
    # so the engine can meet the death on step 2, the one it was collecting (seen under load).
    failed = f"stage {stage} tp rank {rank} failed in step {'[23]' if pp > 1 else '3'}"
    with pytest.raises(WorkerFailedError, match=failed):
        engine.generate(prompts, SamplingParams(max_tokens=4), groups)
    with pytest.raises(WorkerFailedError, match="shut down"):  # no half-alive engine
        engine.step()
        engine.step()
    assert all(s["state"] == "REMOVED" for s in ray.util.placement_group_table().values())
