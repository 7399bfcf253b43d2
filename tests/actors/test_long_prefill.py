"""Long prompts in prefill do not hold newcomers back (issue 18 case 8): with a `chunk_size`,
running prefills leave room for the next admission's first chunk, so a short request added
while long prompts prefill gets its first token in the next step (counted in steps), and
every output stays token-identical to Hugging Face `generate` and to the uncapped engine.
Without a chunk size (the offline default) a prefill still takes the whole step."""

from __future__ import annotations

import pytest

from actors import SamplingParams
from actors.request import Request
from pipeline.serve.config import ServeConfig
from tests.actors.reference import assert_greedy_match, hf_greedy, sample_prompts
from tests.actors.test_scheduler import make, req, run

MAX_TOKENS = 8
PARAMS = SamplingParams(max_tokens=MAX_TOKENS)
BUDGET, CHUNK = 32, 16


@pytest.fixture(scope="module")
def long_prompts(tokenizer) -> list[list[int]]:
    """Three prompts of 300 tokens (each ~19 steps of prefill at 16 tokens a step)."""
    text = " ".join(sample_prompts(80))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) >= 3 * 300 + 20
    return [ids[i * 300 : (i + 1) * 300] for i in range(3)]


@pytest.fixture(scope="module")
def short_prompts(tokenizer) -> list[list[int]]:
    texts = sample_prompts(6, start=80)
    return [tokenizer.encode(t, add_special_tokens=False)[:5] for t in texts]


def drive(engine, long_ids, short_ids, *, arrive_after: int = 2) -> tuple[dict, dict, dict]:
    """Queue the long prompts, step `arrive_after` times, then add one short request per step.
    Returns each request's arrival step and first-token step (steps counted from 1), and the
    final outputs."""
    arrived = {f"long{i}": 1 for i in range(len(long_ids))}
    for i, ids in enumerate(long_ids):
        engine.add_request(ids, PARAMS, request_id=f"long{i}")
    first: dict[str, int] = {}
    finals = {}
    for step in range(1, 400):
        index = step - 1 - arrive_after
        if 0 <= index < len(short_ids):
            engine.add_request(short_ids[index], PARAMS, request_id=f"short{index}")
            arrived[f"short{index}"] = step
        for out in engine.step():
            if out.token_ids:
                first.setdefault(out.request_id, step)
            if out.finished:
                finals[out.request_id] = out
        if not engine.has_unfinished() and len(finals) == len(arrived):
            break
    assert len(finals) == len(long_ids) + len(short_ids)
    return arrived, first, finals


def steps_to_first_token(arrived: dict, first: dict) -> list[int]:
    """Steps each short request took to its first token (1: the step it arrived before)."""
    shorts = sorted((r for r in arrived if r.startswith("short")), key=lambda r: int(r[5:]))
    return [first[r] - arrived[r] + 1 for r in shorts]


def test_newcomers_start_in_the_next_step_while_long_prompts_prefill(
    make_engine, reference_models, long_prompts, short_prompts
) -> None:
    engine = make_engine(max_num_batched_tokens=BUDGET, chunk_size=CHUNK, num_kv_blocks=128)
    arrived, first, finals = drive(engine, long_prompts, short_prompts)
    # Each newcomer's first token in its first step, while two long prompts still prefill.
    assert steps_to_first_token(arrived, first) == [1] * len(short_prompts)
    assert first["long0"] > first["short0"] and first["long1"] > first["short0"]

    uncapped = make_engine(max_num_batched_tokens=BUDGET, num_kv_blocks=128)
    arrived, first, uncapped_finals = drive(uncapped, long_prompts, short_prompts)
    assert steps_to_first_token(arrived, first)[0] > 10  # it waited out the long prefills

    model = reference_models["llama"]
    prompts = {f"long{i}": ids for i, ids in enumerate(long_prompts)}
    prompts.update((f"short{i}", ids) for i, ids in enumerate(short_prompts))
    for rid, ids in prompts.items():
        out = finals[rid]
        assert out.finished and out.error is None, rid
        assert out.token_ids == uncapped_finals[rid].token_ids, rid
        assert_greedy_match(model, ids, out.token_ids, hf_greedy(model, ids, MAX_TOKENS))
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_running_prefills_leave_room_for_one_admission() -> None:
    s = make(max_num_batched_tokens=BUDGET, chunk_size=CHUNK)
    a, b = req("a", 100), req("b", 100, start=200)
    s.add(a)
    s.add(b)
    assert run(s).num_scheduled_tokens == {"a": CHUNK, "b": CHUNK}  # the whole budget
    s.add(req("c", 5, start=500))
    assert run(s).num_scheduled_tokens == {"a": CHUNK, "b": BUDGET - CHUNK - 5, "c": 5}
    s.add(req("d", 60, start=700))  # a long newcomer: its first chunk, at most half a step
    # c decodes first; a leaves d a chunk; b, held back, gets nothing this step.
    assert run(s).num_scheduled_tokens == {"c": 1, "a": BUDGET - 1 - CHUNK, "d": CHUNK}


def test_a_reserve_the_admission_does_not_use_goes_back_to_the_prefills() -> None:
    s = make(max_num_batched_tokens=BUDGET, chunk_size=CHUNK, prefix_caching=True)
    cached = req("cached", 12, start=900)  # 3 full blocks of 4 tokens, then freed
    s.add(cached)
    run(s)
    s.finish([cached], "stop")
    a, b = req("a", 100), req("b", 100, start=200)
    s.add(a)
    s.add(b)
    run(s)
    s.add(Request("c", list(range(900, 913)), SamplingParams()))  # its first 12 are cached
    # 13 tokens are held for c, which needs 1: b gets the other 12 back, the step is full.
    assert run(s).num_scheduled_tokens == {"a": CHUNK, "b": 15, "c": 1}


def test_without_a_chunk_size_a_prefill_takes_the_whole_step() -> None:
    s = make(max_num_batched_tokens=BUDGET)
    s.add(req("a", 100))
    run(s)
    s.add(req("c", 5, start=500))
    assert run(s).num_scheduled_tokens == {"a": BUDGET}


def test_no_reserve_when_nothing_can_be_admitted() -> None:
    s = make(max_num_batched_tokens=BUDGET, chunk_size=CHUNK, max_num_seqs=2)
    for r in (req("a", 100), req("b", 100, start=200), req("c", 5, start=500)):
        s.add(r)
    run(s)
    assert run(s).num_scheduled_tokens == {"a": CHUNK, "b": CHUNK}  # c cannot run yet


def test_serving_caps_prefill_chunks_by_default() -> None:
    from actors import EngineConfig

    assert (
        ServeConfig().engine.chunk_size == EngineConfig(dtype="float32").max_num_batched_tokens // 2
    )
    engine = EngineConfig(dtype="float32", max_num_batched_tokens=64, chunk_size=48)
    assert ServeConfig(engine=engine).engine.chunk_size == 48  # a chosen size is kept
    assert (
        EngineConfig(dtype="float32").chunk_size is None
    )  # the offline job keeps whole-budget prefills
