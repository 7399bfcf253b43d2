"""Greedy outputs equal Hugging Face `generate` on each prompt alone, on every engine path:
chunk sizes, prefix groups, preemption, requests arriving between steps; and the packed
prefill's KV equals each prompt's own KV. Each over every attention backend this machine
runs (the `attention_backend` fixture)."""

from __future__ import annotations

import pytest
import torch

from actors import SamplingParams
from actors.attention.sdpa import SdpaDecodeBackend
from packing.layout import token_slots
from tests.actors.groups import prefix_groups_for, shared_prefix_prompts
from tests.actors.reference import (
    assert_greedy_match,
    hf_greedy,
    sample_prompts,
    torch_threads,
)

ARCHS = ("llama", "qwen2", "mistral")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p, add_special_tokens=False) for p in shared_prefix_prompts()]


@pytest.fixture(scope="module")
def expected(reference_models, prompt_ids) -> dict[str, list[list[int]]]:
    """Reference tokens per architecture, each prompt generated alone."""
    with torch_threads(1):
        return {
            arch: [hf_greedy(model, ids, MAX_TOKENS) for ids in prompt_ids]
            for arch, model in reference_models.items()
        }


def check_all(reference_model, prompt_ids, outputs, expected) -> None:
    for ids, out, exp in zip(prompt_ids, outputs, expected, strict=True):
        assert out.finished and out.error is None
        assert_greedy_match(reference_model, ids, out.token_ids, exp)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk_size", [7, 32, None])
@pytest.mark.parametrize("grouped", [False, True], ids=["no-groups", "groups"])
def test_greedy_matches_hf_generate(
    make_engine,
    reference_models,
    prompt_ids,
    expected,
    arch,
    chunk_size,
    grouped,
    attention_backend,
) -> None:
    budget = 64 if chunk_size == 32 else 512  # 32: several chunks also share a small budget
    engine = make_engine(
        arch,
        num_kv_blocks=256,
        chunk_size=chunk_size,
        max_num_batched_tokens=budget,
        attention_backend=attention_backend,
    )
    groups = prefix_groups_for(prompt_ids) if grouped else None
    outputs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS), groups)
    check_all(reference_models[arch], prompt_ids, outputs, expected[arch])
    if grouped:
        for group in groups or ():
            assert group.prefix_len % engine.config.block_size != 0  # the copy path runs
            for m in group.members:
                assert outputs[m].num_cached_tokens >= group.prefix_len


@pytest.mark.parametrize("arch", ARCHS)
def test_sdpa_decode_fallback_matches_hf_generate(
    make_engine, reference_models, prompt_ids, expected, arch
) -> None:
    """Without the compiled decode kernel (no compiler, or the sdpa backend chosen) decodes
    gather their blocks for SDPA: the same tokens."""
    engine = make_engine(arch, num_kv_blocks=256, attention_backend="sdpa")
    assert isinstance(engine.runner.attention_backend.decode, SdpaDecodeBackend)
    outputs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS))
    check_all(reference_models[arch], prompt_ids, outputs, expected[arch])


def test_prefix_group_prefix_is_computed_once(
    make_engine, reference_models, prompt_ids, expected, attention_backend
):
    engine = make_engine(
        "llama",
        num_kv_blocks=256,
        enable_prefix_caching=False,
        attention_backend=attention_backend,
    )
    groups = prefix_groups_for(prompt_ids)
    computed = []
    scheduler = engine.scheduler.schedulers[0]  # the one request set
    original = scheduler.update_after_step

    def record(out):  # count every token the model computes
        computed.append(out.total_num_scheduled_tokens)
        original(out)

    scheduler.update_after_step = record  # type: ignore[method-assign]
    outputs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS), groups)
    check_all(reference_models["llama"], prompt_ids, outputs, expected["llama"])
    saved = sum(g.prefix_len * (len(g.members) - 1) for g in groups)
    # Each request computes its prompt and all but its last generated token, minus what the
    # groups share; each group's prefix is computed once.
    plain = sum(
        len(ids) + len(out.token_ids) - 1 for ids, out in zip(prompt_ids, outputs, strict=True)
    )
    assert sum(computed) == plain - saved
    for g in groups:
        assert all(outputs[m].num_cached_tokens == g.prefix_len for m in g.members)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks  # the prefixes were released


@pytest.mark.parametrize("grouped", [False, True], ids=["no-groups", "groups"])
def test_preemption_keeps_outputs(
    make_engine, reference_models, prompt_ids, expected, grouped, attention_backend
):
    # 60 blocks of 4 tokens: the longest prompt fits, all of them together do not.
    engine = make_engine(
        "qwen2",
        num_kv_blocks=60,
        block_size=4,
        max_num_batched_tokens=96,
        attention_backend=attention_backend,
    )
    groups = prefix_groups_for(prompt_ids) if grouped else None
    outputs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS), groups)
    assert engine.scheduler.num_preemptions > 0
    check_all(reference_models["qwen2"], prompt_ids, outputs, expected["qwen2"])


def test_requests_arriving_between_steps(
    make_engine, reference_models, prompt_ids, expected, attention_backend
):
    engine = make_engine(
        "mistral", num_kv_blocks=256, chunk_size=16, attention_backend=attention_backend
    )
    params = SamplingParams(max_tokens=MAX_TOKENS)
    finished = {}
    ids: dict[str, int] = {}
    arrivals = {0: range(0, 3), 2: range(3, 6), 5: range(6, len(prompt_ids))}
    for step in range(12):
        # New requests join running decodes and chunked prefills.
        for i in arrivals.get(step, ()):
            ids[engine.add_request(prompt_ids[i], params)] = i
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    while engine.has_unfinished():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert len(finished) == len(ids)
    for rid, i in ids.items():
        assert_greedy_match(
            reference_models["mistral"],
            prompt_ids[i],
            finished[rid].token_ids,
            expected["mistral"][i],
        )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk_size", [7, None])
def test_packed_prefill_kv_equals_solo_kv(
    make_engine, reference_models, prompt_ids, arch, chunk_size, attention_backend
):
    engine = make_engine(
        arch, num_kv_blocks=256, chunk_size=chunk_size, attention_backend=attention_backend
    )
    chosen = [prompt_ids[0], prompt_ids[5], prompt_ids[7], prompt_ids[8]]
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    rids = [engine.add_request(ids, params) for ids in chosen]
    while any(engine._requests[r].num_output_tokens == 0 for r in rids):
        engine.step()
    bs = engine.config.block_size
    for rid, ids in zip(rids, chosen, strict=True):
        req = engine._requests[rid]
        slots = torch.from_numpy(token_slots(req.block_ids, len(ids), bs))
        with torch.inference_mode():
            solo = reference_models[arch](torch.tensor([ids]), use_cache=True).past_key_values
        for layer, (k_cache, v_cache) in enumerate(engine.runner.kv_caches):
            heads, dim = k_cache.shape[2:]
            k = k_cache.view(-1, heads, dim)[slots].transpose(0, 1)  # [heads, n, dim]
            v = v_cache.view(-1, heads, dim)[slots].transpose(0, 1)
            torch.testing.assert_close(k, solo.layers[layer].keys[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(v, solo.layers[layer].values[0], atol=1e-5, rtol=0)


def test_many_concurrent_decodes_span_several_attention_chunks(
    make_engine, reference_models, attention_backend
):
    from actors.attention import DECODE_CHUNK

    texts = sample_prompts(3 * DECODE_CHUNK, start=30)
    engine = make_engine("llama", num_kv_blocks=512, attention_backend=attention_backend)
    prompts = [engine.tokenizer.encode(t, add_special_tokens=False)[:40] for t in texts]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=6))
    with torch_threads(1):
        for ids, out in zip(prompts, outputs, strict=True):
            expected = hf_greedy(reference_models["llama"], ids, 6)
            assert_greedy_match(reference_models["llama"], ids, out.token_ids, expected)
