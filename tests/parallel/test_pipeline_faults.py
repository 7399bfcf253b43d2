"""A tp=2 x pp=2 engine over one Ray task per worker per step (the CPU default): it isolates a
failing request as the single-process engine does (tests/actors/test_fault_isolation.py): a
prefix-group member failing at admission and another failing mid-decode end alone, the other
prompts keep the single-process tokens, and every set's KV blocks and bookkeeping are
released; then every prompt again gives the single-process tokens (now from its prefix cache)
and a worker killed mid-step fails the engine loudly. One engine group for the three checks
(four worker processes importing torch): the tp2xpp2 engine that only compared tokens
(test_pipeline_parallel.py) and test_failures.py's pp=2 engine that answered and then lost a
stage are this one (pp=2 alone over Ray tasks: test_rope_parallel.py[phi3-pp2])."""

from __future__ import annotations

import pytest

from actors import LLMEngine, SamplingParams
from actors.loader import load_tokenizer
from tests.actors.reference import torch_threads
from tests.actors.test_fault_isolation import FailingDetokenizer
from tests.parallel.conftest import (
    MAX_TOKENS,
    assert_killed_worker_fails_loudly,
    assert_same_tokens,
    engine_config,
    run_engine,
)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_pipelined_engine_fails_only_the_bad_requests_then_a_killed_worker_fails_loudly(
    ray_local, llama_dir, prompts_and_groups
) -> None:
    prompts, groups = prompts_and_groups
    expected = run_engine(engine_config(llama_dir), prompts, groups)
    bad = {2: ("start", 0), 6: ("update", 2)}  # a member of each group
    stages = {tuple(prompts[i]): stage for i, stage in bad.items()}

    class Planted(FailingDetokenizer):
        def _maybe_fail(self, stage, request):
            planted = stages.get(tuple(request.prompt_token_ids))
            if planted is not None and planted[0] == stage:
                self.stage, self.after = planted
                super()._maybe_fail(stage, request)

    config = engine_config(llama_dir, tensor_parallel_size=2, pipeline_parallel_size=2)
    with torch_threads(1):
        engine = LLMEngine(config)  # on CPU: one Ray task per worker per step
        try:
            detokenizer = engine.detokenizer
            engine.detokenizer = Planted(load_tokenizer("smollm2"), "", lambda r: True)
            outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), groups)
            later = engine.generate(prompts[:1], SamplingParams(max_tokens=MAX_TOKENS))[0]
            engine.detokenizer = detokenizer
            free = [kv.num_free_blocks == kv.num_blocks for kv in engine.scheduler.kvs]
            owed, owner = list(engine.scheduler._owed), dict(engine.scheduler._owner)
            idle = not engine.scheduler.running and not engine.scheduler.waiting
            again = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), groups)
            assert all(o.finished and o.error is None for o in again)
            assert_same_tokens(llama_dir, prompts, [o.token_ids for o in again], expected)
            assert_killed_worker_fails_loudly(engine, 1, 0, prompts, groups)
        finally:
            engine.runner.shutdown()
    for index, (stage, _) in bad.items():
        assert outputs[index].finish_reason == "error"
        assert f"planted {stage} failure" in (outputs[index].error or "")
    good = [i for i in range(len(prompts)) if i not in bad]
    got = [outputs[i].token_ids for i in good]
    assert all(outputs[i].error is None for i in good)
    assert_same_tokens(llama_dir, [prompts[i] for i in good], got, [expected[i] for i in good])
    assert later.error is None and later.token_ids == outputs[0].token_ids
    assert not owner and owed == [0, 0]
    assert all(free)
    assert idle
