"""Length-dependent rope (longrope, dynamic NTK) per request: greedy equal to HF `generate` on
each prompt alone, on every path (packed with longer and shorter prompts, crossing the
threshold while generating, chunked, prefix cache, prefix groups).

The tiny models' short and long factors (and the NTK factor) differ a lot, and
`test_factors_matter` shows the outputs change with them: the comparisons test the rope.
"""

from __future__ import annotations

import pytest
import torch

from actors import EngineConfig, LLMEngine, SamplingParams
from actors.attention import available_backends
from actors.rope import RequestRotary
from packing.prefix import PrefixGroup
from tests.actors.rope_models import LENGTHS, MAX_NEW, hf_alone, prompts, rope_model

KINDS = ["phi3", "phi4", "llama"]  # longrope, longrope on 3/4 of each head, dynamic NTK


@pytest.fixture(scope="module")
def references():
    """The reference model and HF's tokens per prompt, per kind, computed once."""
    cache: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    models = {kind: rope_model(kind) for kind in KINDS}

    def expected(kind: str, prompt: list[int]) -> list[int]:
        key = (kind, tuple(prompt))
        if key not in cache:
            cache[key] = hf_alone(models[kind], prompt)
        return cache[key]

    return expected


@pytest.fixture(params=["sdpa", "cpu_kernel"])
def backend(request) -> str:
    """The SDPA backend, and the C decode kernel (with shared-prefix decode attention)."""
    if request.param not in available_backends("cpu", torch.float32):
        pytest.skip(f"{request.param} cannot run here")
    return str(request.param)


def engine(kind: str, tokenizer, **config) -> LLMEngine:
    """An engine over a fresh copy of the tiny rope model."""
    config.setdefault("num_kv_blocks", 256)
    config.setdefault("attention_backend", "sdpa")
    return LLMEngine(EngineConfig(**config), model=rope_model(kind), tokenizer=tokenizer)


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def check(eng: LLMEngine, kind: str, batch: list[list[int]], expected, groups=None) -> int:
    """Every prompt's tokens equal HF's alone; returns the prompt tokens served cached."""
    outs = eng.generate(batch, GREEDY, prefix_groups=groups)
    for prompt, out in zip(batch, outs, strict=True):
        assert out.finish_reason == "length", out.error
        assert list(out.token_ids) == expected(kind, prompt), f"prompt of {len(prompt)} tokens"
    return sum(out.num_cached_tokens for out in outs)


@pytest.mark.parametrize("kind", KINDS)
def test_factors_matter(kind):
    """The same weights with plain rope generate otherwise past the threshold (the other
    tests would pass with any frequencies if not), and the engine wraps the rotary."""
    scaled, plain = rope_model(kind), rope_model(kind, rope="default")
    batch = prompts([60, 100, 150])
    differ = [hf_alone(scaled, p) != hf_alone(plain, p) for p in batch]
    assert all(differ), differ


@pytest.mark.parametrize("kind", KINDS)
def test_packed_short_and_long(kind, backend, tokenizer, references):
    """Short and long prompts in the same steps, each as HF alone, with the steps really
    packing both (one step holds every prompt)."""
    eng = engine(kind, tokenizer, max_num_batched_tokens=1024, attention_backend=backend)
    assert isinstance(eng.model.get_decoder().rotary_emb, RequestRotary)
    check(eng, kind, prompts(LENGTHS), references)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked(kind, backend, tokenizer, references):
    """Chunks of 16: every chunk of a prompt uses the whole prompt's frequencies."""
    eng = engine(
        kind, tokenizer, chunk_size=16, max_num_batched_tokens=48, attention_backend=backend
    )
    check(eng, kind, prompts(LENGTHS, seed=5), references)


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_cache(kind, backend, tokenizer, references):
    """Prompts sharing 48 tokens on both sides of the threshold, twice through one engine:
    a cached block is reused only by requests whose rope gives it the same K/V."""
    eng = engine(kind, tokenizer, enable_prefix_caching=True, attention_backend=backend)
    batch = prompts([50, 60, 70, 100, 100, 130], shared=48, seed=7)
    check(eng, kind, batch, references)
    assert check(eng, kind, batch[::-1], references) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_groups(kind, backend, tokenizer, references):
    """Planner groups whose members fall on both sides of the threshold (nested too)."""
    eng = engine(kind, tokenizer, enable_prefix_caching=False, attention_backend=backend)
    batch = prompts([55, 60, 62, 90, 90, 120], shared=32, seed=11)  # 0 and 1 cross 64
    batch[4] = batch[3][:80] + batch[4][80:]  # 3 and 4 share 80 tokens
    batch[1] = batch[0][:33] + batch[1][33:]
    groups = [
        PrefixGroup(members=(0, 1, 2, 3, 4, 5), prefix_len=32),
        PrefixGroup(members=(0, 1), prefix_len=33, parent=0),
        PrefixGroup(members=(3, 4), prefix_len=80, parent=0),
    ]
    assert check(eng, kind, batch, references, groups) > 0  # nested groups 1 and 2 share


@pytest.mark.parametrize("kind", KINDS)
def test_preemption(kind, tokenizer, references):
    """A pool too small for every prompt: preempted requests are recomputed with the rope
    lengths their tokens first had (prompt tokens the prompt's, generated ones their own)."""
    eng = engine(kind, tokenizer, num_kv_blocks=20, block_size=8, max_num_batched_tokens=256)
    check(eng, kind, prompts([40, 60, 62, 70, 90], seed=17), references)
    assert eng.scheduler.num_preemptions > 0


@pytest.mark.parametrize("kind,context", [("phi3", 256), ("phi4", 256), ("llama", 256)])
def test_context_is_the_models(kind, context, tokenizer):
    """longrope: max_position_embeddings; dynamic NTK: factor x max_position_embeddings
    (vLLM's length; HF sets none), never the unscaled 64."""
    assert engine(kind, tokenizer, num_kv_blocks=64).max_model_len == context


def test_two_engines_over_one_model(tokenizer, references):
    """A second engine over the same model object keeps one per-request rotary."""
    model = rope_model("llama")
    config = EngineConfig(dtype="float32", num_kv_blocks=64, attention_backend="sdpa")
    LLMEngine(config, model=model, tokenizer=tokenizer)
    eng = LLMEngine(config, model=model, tokenizer=tokenizer)
    assert not isinstance(model.get_decoder().rotary_emb.inner, RequestRotary)
    check(eng, "llama", prompts([30, 100], seed=19), references)


def test_per_layer_length_rope_is_refused():
    """A longrope/dynamic rope per layer type is refused at load, naming the model type."""
    from types import SimpleNamespace

    from actors.rope import RopePolicy

    text = SimpleNamespace(
        model_type="gemma3_text",
        rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 2.0}},
    )
    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text))
    with pytest.raises(ValueError, match="gemma3_text: rope_type longrope/dynamic per layer"):
        RopePolicy.of(model)
