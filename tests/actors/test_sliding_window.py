"""Sliding windows and logit softcaps through the engine: tiny models with a 32-token window
(Mistral on every layer, Qwen2 from max_window_layers on, Gemma 2 and Gemma 3 interleaving
local and global layers) and a Gemma 2 whose softcap (2.0) and query_pre_attn_scalar decide
its tokens, on prompts of 4-6 windows, greedy identical to Hugging Face `generate` on each
prompt alone: packed, chunked, from the prefix cache, in prefix groups and through
shared-prefix attention, over every attention backend this machine runs. Each model's
outputs differ from the same weights' without the window and the cap, so a backend that
ignored either would fail here."""

from __future__ import annotations

import pytest
import torch

from actors import EngineConfig, LLMEngine, SamplingParams
from actors.agreement import agreement, greedy_targets, teacher_forced
from actors.attention.shared_prefix import SharedPrefixDecodeBackend
from tests.actors.reference import assert_greedy_match, hf_greedy
from tests.actors.window_models import (
    MODELS,
    WINDOW,
    long_prompt_groups,
    long_prompt_ids,
    window_model,
)

MAX_TOKENS = 12
PATHS = ("packed", "chunked", "prefix-cached", "prefix-groups", "shared-prefix")


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    ids = long_prompt_ids(tokenizer)
    assert min(len(p) for p in ids) >= 4 * WINDOW
    return ids


@pytest.fixture(scope="module")
def expected(prompt_ids):
    """Hugging Face's greedy tokens per model, each prompt alone (computed when first asked)."""
    found: dict[str, list[list[int]]] = {}

    def get(name: str) -> list[list[int]]:
        if name not in found:
            model = window_model(name)
            found[name] = [hf_greedy(model, ids, MAX_TOKENS) for ids in prompt_ids]
        return found[name]

    return get


def make_engine(tokenizer, name: str, dtype: torch.dtype = torch.float32, **config) -> LLMEngine:
    config.setdefault("num_kv_blocks", 256)
    config.setdefault("max_num_batched_tokens", 2048)  # every prompt in one packed step
    dtype_name = str(dtype).removeprefix("torch.")
    return LLMEngine(
        EngineConfig(dtype=dtype_name, **config),
        model=window_model(name, dtype=dtype),
        tokenizer=tokenizer,
    )


@pytest.mark.parametrize("name", list(MODELS))
def test_the_window_and_the_cap_change_these_outputs(prompt_ids, expected, name) -> None:
    """Without the window (and the softcap and Gemma's scale) the same weights generate
    otherwise on every prompt: the tests below can fail."""
    plain = window_model(name, windowed=False)
    differ = [
        hf_greedy(plain, ids, MAX_TOKENS) != exp
        for ids, exp in zip(prompt_ids, expected(name), strict=True)
    ]
    assert all(differ), differ


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_matches_hf_generate_past_the_window(
    tokenizer, prompt_ids, expected, name, path, attention_backend
) -> None:
    if path == "shared-prefix" and attention_backend != "cpu_kernel":
        pytest.skip("shared-prefix attention is the C kernel's")
    config: dict = dict(attention_backend=attention_backend)
    groups = None
    if path == "chunked":
        config.update(chunk_size=7, max_num_batched_tokens=64)
    elif path == "prefix-groups":
        groups = long_prompt_groups(prompt_ids)
        config.update(shared_prefix_attention=False)
    elif path == "shared-prefix":
        groups = long_prompt_groups(prompt_ids)
        config.update(shared_prefix_attention=True, shared_prefix_min_keys=1)
    engine = make_engine(tokenizer, name, **config)
    assert engine.max_model_len == 1024  # the model's context, not the window
    if path == "shared-prefix":
        assert isinstance(engine.runner.attention_backend.decode, SharedPrefixDecodeBackend)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    outputs = engine.generate(prompt_ids, params, groups)
    if path == "prefix-cached":  # again: every prompt's full blocks now come from the cache
        outputs = engine.generate(prompt_ids, params)
        assert all(o.num_cached_tokens >= 3 * WINDOW for o in outputs)
    model = window_model(name)
    for ids, out, exp in zip(prompt_ids, outputs, expected(name), strict=True):
        assert out.finished and out.error is None
        assert_greedy_match(model, ids, out.token_ids, exp)


@pytest.mark.parametrize("name", ["gemma2", "gemma2_softcap", "mistral"])
def test_bfloat16_agrees_with_float32_past_the_window(tokenizer, prompt_ids, name) -> None:
    """The bf16 kernel's window and softcap: teacher-forced agreement with the float32
    engine within tests/actors/test_bf16_agreement.py's bound. Measured (torch 2.13 CPU):
    top-1 0.979 / 0.990 / 0.969 and mean |dlogprob| 0.0011 / 0.0013 / 0.0035 (gemma2,
    gemma2_softcap, mistral); the bf16 kernel without its window: top-1 0.77 and 0.08,
    without its softcap 0.69."""
    from tests.actors.test_bf16_agreement import MAX_MEAN_ABS_DLOGPROB, MIN_TOP1

    fp32 = make_engine(tokenizer, name)
    bf16 = make_engine(tokenizer, name, torch.bfloat16, attention_backend="cpu_kernel")
    targets = greedy_targets(fp32, prompt_ids, MAX_TOKENS)
    reference = teacher_forced(fp32, prompt_ids, targets)
    result = agreement(reference, teacher_forced(bf16, prompt_ids, targets), targets)
    assert result["top1_agreement"] >= MIN_TOP1, result
    assert result["mean_abs_logprob_diff"] <= MAX_MEAN_ABS_DLOGPROB, result
