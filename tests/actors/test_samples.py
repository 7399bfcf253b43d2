"""Several samples per prompt (`SamplingParams.n`, `best_of`): one prefill per prompt (the
samples' prompt tokens counted as cached, the step tokens counted exactly), greedy samples
equal to Hugging Face `generate`, seeded samples reproducible (sample i draws from seed + i),
best_of keeps the best n, inside the planner's prefix groups too, and through add_request."""

from __future__ import annotations

import pytest

from actors import SamplingParams
from actors.samples import sample_params
from packing.prefix import PrefixGroup
from tests.actors.groups import SYSTEM
from tests.actors.reference import assert_greedy_match, hf_greedy, sample_prompts

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(SYSTEM + p) for p in sample_prompts(3)]


def test_greedy_n4_prefills_once_and_equals_hf(make_engine, reference_models, prompt_ids):
    # The prompts share SYSTEM: the engine's own groups over them would save more (counted in
    # test_nested_groups.py); here each prompt's samples alone.
    engine = make_engine(plan_prefix_groups=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, n=4, ignore_eos=True)
    outs = engine.generate(prompt_ids, params)
    assert len(outs) == 4 * len(prompt_ids)
    for p, ids in enumerate(prompt_ids):
        samples = outs[4 * p : 4 * p + 4]
        assert [o.sample_index for o in samples] == [0, 1, 2, 3]
        assert {o.request_id for o in samples} == {samples[0].request_id}
        # Every sample took the prompt but its last token from the shared prefill.
        assert [o.num_cached_tokens for o in samples] == [len(ids) - 1] * 4
        assert len({o.token_ids for o in samples}) == 1
        expected = hf_greedy(reference_models["llama"], ids, MAX_TOKENS)
        assert_greedy_match(reference_models["llama"], ids, samples[0].token_ids, expected)
    # Computed tokens: each prompt but its last token once, then per sample its last prompt
    # token and MAX_TOKENS - 1 decodes (n separate prompts would compute n whole prompts).
    expected_tokens = sum(len(ids) - 1 + 4 * MAX_TOKENS for ids in prompt_ids)
    assert engine.stats.num_scheduled_tokens == expected_tokens


def test_n1_is_unchanged(make_engine, prompt_ids):
    engine = make_engine(plan_prefix_groups=False)  # no groups across the prompts either
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.sample_index for o in outs] == [0, 0, 0]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    assert engine.stats.num_scheduled_tokens == sum(len(i) + MAX_TOKENS - 1 for i in prompt_ids)


def test_seeded_samples_are_reproducible_and_draw_from_seed_plus_index(make_engine, prompt_ids):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7, n=3, ignore_eos=True)
    first = make_engine().generate(prompt_ids[:1], params)
    again = make_engine().generate(prompt_ids[:1], params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert len({o.token_ids for o in first}) > 1  # the samples are not copies of one draw
    for i, out in enumerate(first):
        alone = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7 + i, ignore_eos=True)
        assert make_engine().generate(prompt_ids[:1], alone)[0].token_ids == out.token_ids


def test_best_of_returns_the_n_highest_cumulative_logprobs(make_engine, prompt_ids):
    common = {"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    every = make_engine().generate(prompt_ids[:1], SamplingParams(**common, n=4, logprobs=0))
    best = make_engine().generate(prompt_ids[:1], SamplingParams(**common, n=2, best_of=4))
    ranked = sorted(every, key=lambda o: -(o.cumulative_logprob or 0.0))
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked[:2]]
    assert [o.sample_index for o in best] == [0, 1]
    assert all(o.logprobs is None for o in best)  # computed only to rank them


def test_samples_nest_in_the_planner_groups(make_engine, reference_models, prompt_ids):
    prefix_len = len(SYSTEM) // 8  # well inside the shared system text's tokens
    assert all(ids[:prefix_len] == prompt_ids[0][:prefix_len] for ids in prompt_ids)
    groups = [PrefixGroup(prefix_len=prefix_len, members=(0, 1, 2))]
    params = [SamplingParams(max_tokens=MAX_TOKENS, n=n, ignore_eos=True) for n in (1, 3, 2)]
    outs = make_engine().generate(prompt_ids, params, groups)
    assert [o.sample_index for o in outs] == [0, 0, 1, 2, 0, 1]
    origin = [0, 1, 1, 1, 2, 2]
    for p, out in zip(origin, outs, strict=True):
        expected = hf_greedy(reference_models["llama"], prompt_ids[p], MAX_TOKENS)
        ids = prompt_ids[p]
        assert_greedy_match(reference_models["llama"], ids, out.token_ids, expected)
        cached = prefix_len if params[p].n == 1 else len(ids) - 1
        assert out.num_cached_tokens == cached


def test_add_request_streams_each_sample_and_aborts_them_all(make_engine, prompt_ids):
    engine = make_engine()
    params = SamplingParams(max_tokens=MAX_TOKENS, n=2, ignore_eos=True)
    rid = engine.add_request(prompt_ids[0], params, request_id="mine")
    assert rid == "mine"
    seen: set[int] = set()
    while not seen:
        seen = {o.sample_index for o in engine.step() if o.request_id == "mine"}
    assert seen == {0, 1}
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(prompt_ids[1], params, request_id="mine")
    engine.abort_request("mine")
    finished = [o for o in engine.step() if o.finished]
    assert sorted((o.request_id, o.sample_index, o.finish_reason) for o in finished) == [
        ("mine", 0, "abort"),
        ("mine", 1, "abort"),
    ]
    assert not engine.has_unfinished()


def test_sample_params_and_bounds():
    assert sample_params(SamplingParams(seed=2**64 - 1, n=2), 1).seed == -(2**63)
    assert sample_params(SamplingParams(n=2, best_of=3), 0).logprobs == 0
    assert sample_params(SamplingParams(n=3), 2).seed is None
    with pytest.raises(ValueError, match="best_of must be an integer in \\[3"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="n must be an integer"):
        SamplingParams(n=0)
