"""Greedy tokens do not depend on the step budget: the engine with its TPOT controller (whose
budget changes from step to step) gives the tokens of the fixed budget and of Hugging Face
`generate` on each prompt alone, over every attention backend this machine runs."""

from __future__ import annotations

import pytest

from actors import EngineConfig, SamplingParams
from actors.kv_cache import KVCacheManager
from actors.request import Request
from actors.scheduler import Scheduler
from tests.actors.reference import assert_greedy_match, hf_greedy, sample_prompts, torch_threads

MAX_TOKENS = 10
CEILING = 96


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in sample_prompts(10)]


@pytest.fixture(scope="module")
def expected(reference_models, prompt_ids) -> list[list[int]]:
    with torch_threads(1):
        return [hf_greedy(reference_models["llama"], ids, MAX_TOKENS) for ids in prompt_ids]


def run(engine, prompt_ids) -> list[tuple[int, ...]]:
    """Half the prompts at once, the rest arriving while the first decode (so decodes and
    prefill chunks share steps whose budget the controller sets)."""
    params = SamplingParams(max_tokens=MAX_TOKENS)
    half = len(prompt_ids) // 2
    ids = [engine.add_request(p, params) for p in prompt_ids[:half]]
    finished = {}
    for _ in range(3):
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    ids += [engine.add_request(p, params) for p in prompt_ids[half:]]
    while engine.has_unfinished():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert all(finished[i].error is None for i in ids)
    return [finished[i].token_ids for i in ids]


@pytest.mark.parametrize("chunk_size", [None, 32])
def test_controller_keeps_greedy_tokens(
    make_engine, reference_models, prompt_ids, expected, chunk_size, attention_backend
) -> None:
    common = dict(
        num_kv_blocks=256,
        max_num_batched_tokens=CEILING,
        chunk_size=chunk_size,
        attention_backend=attention_backend,
    )
    fixed = run(make_engine("llama", **common), prompt_ids)
    # A target no step meets: every step is cut, down to the floor (decodes + one block of
    # prefill), so the budget moves with the number of decodes from step to step.
    engine = make_engine("llama", tpot_target_s=1e-9, budget_decrease_factor=0.5, **common)
    controlled = run(engine, prompt_ids)
    assert engine.step_budget is not None
    assert engine.step_budget.num_decreases >= engine.stats.num_steps - 1
    assert engine.step_budget.current < CEILING
    assert controlled == fixed  # token for token, controller on vs off
    for ids, got, exp in zip(prompt_ids, controlled, expected, strict=True):
        assert_greedy_match(reference_models["llama"], ids, got, exp)


@pytest.mark.parametrize("chunk_size", [None, 8])
def test_floor_budget_runs_every_decode_and_a_prefill_block(chunk_size) -> None:
    """At its floor (decodes + one block) a step still runs every decode and one block of
    prefill while prompts wait (the scheduler alone, each step pretended, 30 tokens each)."""
    block = 4
    config = EngineConfig(
        dtype="float32", num_kv_blocks=256, block_size=block, chunk_size=chunk_size
    )
    scheduler = Scheduler(config, KVCacheManager(256, block, False))
    for i in range(12):
        scheduler.add(Request(f"r{i}", list(range(100 * i, 100 * i + 5 + 7 * i)), SamplingParams()))
    most_decodes = 0
    while scheduler.has_unfinished():
        decodes = scheduler.num_decodes
        most_decodes = max(most_decodes, decodes)
        prefill_left = sum(r.num_uncomputed_tokens for r in scheduler.waiting) + sum(
            r.num_uncomputed_tokens for r in scheduler.running if r.num_uncomputed_tokens > 1
        )
        out = scheduler.schedule(decodes + block)
        assert out.num_decodes == decodes and out.token_budget == decodes + block
        assert sum(1 for _, n in out.scheduled if n == 1) >= decodes
        assert out.total_num_scheduled_tokens - decodes >= min(block, prefill_left)
        scheduler.update_after_step(out)
        for req, _ in out.scheduled:
            if req.num_computed_tokens == req.num_tokens:
                req.append_token(7)
        scheduler.finish([r for r in scheduler.running if r.num_output_tokens >= 30], "length")
    assert most_decodes >= 3  # decodes and prefill shared steps


def test_config_validates_the_controller_knobs() -> None:
    assert EngineConfig(dtype="float32").step_budget_config() is None
    config = EngineConfig(
        dtype="float32", tpot_target_s=0.2, max_num_batched_tokens=256
    ).step_budget_config()
    assert config is not None and config.ceiling == 256 and config.min_prefill_tokens == 16
    with pytest.raises(ValueError, match="tpot_target_s"):
        EngineConfig(dtype="float32", tpot_target_s=0.0)
    with pytest.raises(ValueError, match="decrease_factor"):
        EngineConfig(dtype="float32", tpot_target_s=0.1, budget_decrease_factor=1.5)
