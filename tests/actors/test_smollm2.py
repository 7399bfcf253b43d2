"""Greedy exactness on the embedded SmolLM2-135M-Instruct with real chat-templated prompts."""

from __future__ import annotations

import pytest

from actors import EngineConfig, LLMEngine, SamplingParams
from actors.loader import load_model
from tests.actors.groups import PrefixGroup, common_prefix_len
from tests.actors.reference import assert_greedy_match, hf_greedy, sample_prompts

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference():
    return load_model("smollm2")


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    """Four chat-templated HH-RLHF requests; the template's system prompt is a shared prefix."""
    ids = []
    for request in sample_prompts(4, start=10):
        messages = [{"role": "user", "content": request}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids.append(tokenizer.encode(text, add_special_tokens=False))
    return ids


@pytest.fixture(scope="module")
def expected(reference, prompt_ids) -> list[list[int]]:
    return [hf_greedy(reference, ids, MAX_TOKENS) for ids in prompt_ids]


# Chunked prefill (7: many chunk boundaries, a chunk ending inside the shared prefix) and
# none; a chunk of 32 went the same chunked path with fewer boundaries.
@pytest.mark.parametrize("chunk_size", [7, None])
@pytest.mark.parametrize("grouped", [False, True], ids=["no-groups", "groups"])
def test_smollm2_greedy_matches_hf_generate(
    tokenizer, reference, prompt_ids, expected, chunk_size, grouped
) -> None:
    engine = LLMEngine(
        EngineConfig(dtype="float32", num_kv_blocks=128, chunk_size=chunk_size),
        model=load_model("smollm2"),
        tokenizer=tokenizer,
    )
    groups = None
    if grouped:
        prefix_len = common_prefix_len(prompt_ids)
        assert prefix_len >= 20  # the chat template's system prompt
        groups = [PrefixGroup(prefix_len=prefix_len, members=tuple(range(len(prompt_ids))))]
    outputs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS), groups)
    for ids, out, exp in zip(prompt_ids, outputs, expected, strict=True):
        assert out.error is None and out.finished
        assert_greedy_match(reference, ids, out.token_ids, exp)
        if grouped:
            assert out.num_cached_tokens >= common_prefix_len(prompt_ids)


def test_smollm2_preemption_keeps_outputs(
    tokenizer, reference, prompt_ids, expected, attention_backend
) -> None:
    """Also over every attention backend (the greedy test above runs "auto" only, to keep
    the suite's time: each case loads and runs the 135M model)."""
    longest = max(len(ids) for ids in prompt_ids) + MAX_TOKENS
    engine = LLMEngine(
        EngineConfig(
            dtype="float32",
            num_kv_blocks=2 * longest // 16 + 2,
            attention_backend=attention_backend,
        ),
        model=load_model("smollm2"),
        tokenizer=tokenizer,
    )
    outputs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS))
    assert engine.scheduler.num_preemptions > 0
    for ids, out, exp in zip(prompt_ids, outputs, expected, strict=True):
        assert_greedy_match(reference, ids, out.token_ids, exp)


def test_smollm2_answers_the_capital_of_france(tokenizer) -> None:
    engine = LLMEngine(
        EngineConfig(dtype="float32", num_kv_blocks=64),
        model=load_model("smollm2"),
        tokenizer=tokenizer,
    )
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = engine.generate([text], SamplingParams(max_tokens=20))[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"
