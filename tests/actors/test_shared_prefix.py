"""Shared-prefix decode attention in the engine (`EngineConfig.shared_prefix_attention`):
greedy tokens identical with it on and off, and equal to Hugging Face `generate` on each
prompt alone, on grouped prompts, nested groups, groups of one member, members that finish
at different steps, blocks shared by the prefix cache alone, and preemption mid-group; and
the shared runs really ran (counted at the backend's `prepare`)."""

from __future__ import annotations

import pytest
import torch

from actors import SamplingParams
from actors.attention.shared_prefix import SharedPrefixDecodeBackend, SharedPrefixDecodes
from actors.kernels import paged_decode_kernel
from packing.prefix import PrefixGroup, prefix_forest
from tests.actors.groups import prefix_groups_for, shared_prefix_prompts
from tests.actors.reference import assert_greedy_match, hf_greedy, torch_threads
from tests.actors.test_nested_groups import conversation_prompts

pytestmark = pytest.mark.skipif(
    paged_decode_kernel("cpu", torch.float32) is None, reason="no C compiler for the kernel"
)

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def grouped_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p, add_special_tokens=False) for p in shared_prefix_prompts()]


@pytest.fixture(scope="module")
def nested_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p, add_special_tokens=False) for p in conversation_prompts()]


def references(reference_models, prompts: list[list[int]], max_tokens) -> list[list[int]]:
    with torch_threads(1):
        return [
            hf_greedy(reference_models["llama"], ids, max_tokens[i])
            for i, ids in enumerate(prompts)
        ]


def runs_counted(engine) -> list[int]:
    """Per step with decodes, how many shared runs the backend read (a spy on `prepare`)."""
    decode = engine.runner.attention_backend.decode
    counts: list[int] = []
    if not isinstance(decode, SharedPrefixDecodeBackend):
        return counts
    original = decode.prepare

    def prepare(batch):
        meta = original(batch)
        counts.append(len(meta.runs) if isinstance(meta, SharedPrefixDecodes) else 0)
        return meta

    decode.prepare = prepare  # type: ignore[method-assign]
    return counts


def generate_both(make_engine, prompts, groups, max_tokens: list[int], **config):
    """Tokens with the backend on and off (each over a fresh engine), and the on engine's
    shared-run counts."""
    params = [SamplingParams(max_tokens=n) for n in max_tokens]
    tokens, counts, engines = {}, [], {}
    for on in (True, False):
        # Every shared run read apart (the tiny prompts' runs are below the default minimum).
        engine = make_engine(
            attention_backend="cpu_kernel",
            shared_prefix_attention=on,
            shared_prefix_min_keys=1,
            **config,
        )
        counted = runs_counted(engine)
        outputs = engine.generate(prompts, params, groups)
        assert all(o.finished and o.error is None for o in outputs)
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        tokens[on] = [list(o.token_ids) for o in outputs]
        engines[on] = engine
        if on:
            counts = counted
    assert tokens[True] == tokens[False]
    return tokens[True], counts, engines


def check_hf(reference_models, prompts, got, max_tokens) -> None:
    for ids, out, exp in zip(
        prompts, got, references(reference_models, prompts, max_tokens), strict=True
    ):
        assert_greedy_match(reference_models["llama"], ids, out, exp)


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_groups_on_equals_off(make_engine, reference_models, grouped_ids, chunk_size) -> None:
    max_tokens = [MAX_TOKENS] * len(grouped_ids)
    max_tokens[1] = 2  # a member that finishes early: its group's run shrinks
    groups = prefix_groups_for(grouped_ids)
    got, counts, _ = generate_both(
        make_engine, grouped_ids, groups, max_tokens, chunk_size=chunk_size, block_size=4
    )
    # Both groups' prefixes read once per step for their members (small chunks prefill the
    # second group's members after the first group's decodes ended).
    assert max(counts) == (2 if chunk_size is None else 1)
    check_hf(reference_models, grouped_ids, got, max_tokens)


def test_nested_groups_on_equals_off(make_engine, reference_models, nested_ids) -> None:
    forest = prefix_forest(nested_ids)
    max_tokens = [MAX_TOKENS] * len(nested_ids)
    got, counts, _ = generate_both(
        make_engine, nested_ids, forest, max_tokens, block_size=4, enable_prefix_caching=False
    )
    assert max(counts) >= 3  # runs at several levels in one step
    check_hf(reference_models, nested_ids, got, max_tokens)


def test_groups_of_one_member(make_engine, reference_models, grouped_ids) -> None:
    """A group with one member shares nothing (no prefix request): plain decodes, and a
    group of two beside it still shares."""
    prompts = grouped_ids[:3]
    groups = [PrefixGroup(prefix_len=20, members=(0,)), PrefixGroup(20, members=(1, 2))]
    max_tokens = [MAX_TOKENS] * 3
    got, counts, _ = generate_both(
        make_engine, prompts, groups, max_tokens, block_size=4, enable_prefix_caching=False
    )
    assert max(counts) == 1
    check_hf(reference_models, prompts, got, max_tokens)


def test_blocks_shared_by_the_prefix_cache(make_engine, reference_models, grouped_ids) -> None:
    """No groups: blocks the block-hash prefix cache shares are read once too."""
    max_tokens = [MAX_TOKENS] * len(grouped_ids)
    got, counts, _ = generate_both(
        make_engine, grouped_ids, None, max_tokens, block_size=4, max_num_batched_tokens=64
    )
    assert max(counts) >= 1
    check_hf(reference_models, grouped_ids, got, max_tokens)


def test_preemption_mid_group(make_engine, reference_models, nested_ids) -> None:
    # 40 blocks of 4 tokens: the longest prompt fits, all of them together do not.
    assert max(map(len, nested_ids)) + MAX_TOKENS < 40 * 4 < sum(map(len, nested_ids))
    forest = prefix_forest(nested_ids)
    max_tokens = [MAX_TOKENS] * len(nested_ids)
    got, counts, engines = generate_both(
        make_engine,
        nested_ids,
        forest,
        max_tokens,
        num_kv_blocks=40,
        block_size=4,
        max_num_batched_tokens=96,
    )
    assert all(e.scheduler.num_preemptions > 0 for e in engines.values())
    assert max(counts) >= 1
    check_hf(reference_models, nested_ids, got, max_tokens)


def test_the_minimum_must_be_positive() -> None:
    from actors import EngineConfig

    with pytest.raises(ValueError, match="shared_prefix_min_keys"):
        EngineConfig(dtype="float32", shared_prefix_min_keys=0)
