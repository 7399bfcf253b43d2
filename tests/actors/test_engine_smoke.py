"""The engine's public API end to end on a tiny model."""

from __future__ import annotations

from actors import SamplingParams
from tests.actors.reference import assert_greedy_match, hf_greedy


def test_generate_matches_hf_greedy(
    make_engine, tokenizer, reference_models, attention_backend
) -> None:
    prompts = ["Hello there, how are you doing today?", "The capital of France is", "x"]
    engine = make_engine(
        "llama",
        num_kv_blocks=64,
        chunk_size=7,
        max_num_batched_tokens=32,
        attention_backend=attention_backend,
    )
    outs = engine.generate(prompts, SamplingParams(max_tokens=10))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        expected = hf_greedy(reference_models["llama"], ids, 10)
        assert_greedy_match(reference_models["llama"], ids, out.token_ids, expected)
        assert out.finished and out.finish_reason in ("stop", "length")
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_add_request_and_step_stream_cumulative_outputs(make_engine) -> None:
    engine = make_engine("llama", num_kv_blocks=64)
    rid = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=4, ignore_eos=True))
    seen = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            seen.append(out)
    assert [len(o.token_ids) for o in seen] == [1, 2, 3, 4]
    assert [o.finished for o in seen] == [False, False, False, True]
    assert seen[-1].finish_reason == "length"
    assert seen[-1].token_ids[:3] == seen[2].token_ids


def test_two_engines_in_one_process_do_not_interfere(make_engine, tokenizer, reference_models):
    a = make_engine("llama", num_kv_blocks=64)
    b = make_engine("qwen2", num_kv_blocks=32, block_size=8)
    prompt = tokenizer.encode("Two engines share a process.", add_special_tokens=False)
    params = SamplingParams(max_tokens=8)
    ra, rb = a.add_request(prompt, params), b.add_request(prompt, params)
    done = {}
    while a.has_unfinished() or b.has_unfinished():  # interleaved steps
        for engine in (a, b):
            done.update((o.request_id + str(id(engine)), o) for o in engine.step() if o.finished)
    for engine, rid, arch in ((a, ra, "llama"), (b, rb, "qwen2")):
        expected = hf_greedy(reference_models[arch], prompt, 8)
        got = done[rid + str(id(engine))].token_ids
        assert_greedy_match(reference_models[arch], prompt, got, expected)


def test_stats_count_steps_and_tokens_and_are_a_snapshot(make_engine) -> None:
    engine = make_engine("llama", num_kv_blocks=64, max_num_batched_tokens=64)
    before = engine.stats
    assert (before.num_steps, before.num_scheduled_tokens, before.num_preemptions) == (0, 0, 0)
    # Both prompts prefill in one step, then three decode steps of two tokens each.
    engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))
    after = engine.stats
    assert after.num_steps == 4 and after.num_scheduled_tokens == 5 + 3 * 2
    assert after.step_seconds > 0
    assert before.num_steps == 0  # the earlier snapshot did not change
