"""The comparison prefill modes (`padded`, `prepack`, length-ordered, solo) give each prompt
exactly the logits and K/V it gets alone, on tiny Llama, Qwen2 and Mistral models (fp32)."""

from __future__ import annotations

import pytest
import torch

from actors import attention
from actors.kv_cache import allocate_kv_tensors
from actors.loader import load_model
from actors.model_runner import model_geometry
from benchmarks import modes
from tests.actors.conftest import context_model
from tests.actors.groups import shared_prefix_prompts
from tests.actors.reference import sample_prompts

ARCHS = ("llama", "qwen2", "mistral")
ATOL = 1e-5


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    """Nine real prompts of 1 to ~150 tokens, some sharing long prefixes."""
    return [tokenizer.encode(p, add_special_tokens=False) for p in shared_prefix_prompts()]


@pytest.fixture(scope="module")
def solo(reference_models, prompt_ids):
    """Per architecture: each prompt's last-token logits and per-layer K/V, run alone through
    the full causal-LM forward (the reference every mode must equal)."""
    out = {}
    with torch.inference_mode():
        for arch, model in reference_models.items():
            runs = [model(torch.tensor([ids]), use_cache=True) for ids in prompt_ids]
            out[arch] = [
                (
                    r.logits[0, -1].float(),
                    [(c.keys[0], c.values[0]) for c in r.past_key_values.layers],
                )
                for r in runs
            ]
    return out


def assert_matches_solo(result: modes.PrefillResult, expected) -> None:
    assert result.logits.shape[0] == len(expected)
    for i, (logits, kv) in enumerate(expected):
        torch.testing.assert_close(result.logits[i], logits, atol=ATOL, rtol=0, msg=f"prompt {i}")
        assert len(result.kv[i]) == len(kv)
        for layer, ((k, v), (k_ref, v_ref)) in enumerate(zip(result.kv[i], kv, strict=True)):
            where = f"prompt {i} layer {layer}"
            torch.testing.assert_close(k, k_ref, atol=ATOL, rtol=0, msg=where)
            torch.testing.assert_close(v, v_ref, atol=ATOL, rtol=0, msg=where)


RUNS = {
    "padded-left": lambda m, p: modes.padded_prefill(m, p),
    "padded-right": lambda m, p: modes.padded_prefill(m, p, padding_side="right"),
    "prepack": lambda m, p: modes.prepack_prefill(m, p),
    "prepack-cap400": lambda m, p: modes.prepack_prefill(m, p, capacity=400),
    "length-ordered-3": lambda m, p: modes.length_ordered_prefill(m, p, batch_size=3),
    "solo": modes.solo_prefill,
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("run", list(RUNS), ids=list(RUNS))
def test_mode_equals_each_prompt_alone(reference_models, prompt_ids, solo, arch, run) -> None:
    result = RUNS[run](reference_models[arch], prompt_ids)
    assert_matches_solo(result, solo[arch])
    assert result.num_prompt_tokens == sum(map(len, prompt_ids))


def test_prepack_packs_several_prompts_per_row(reference_models, prompt_ids) -> None:
    lengths = [len(p) for p in prompt_ids]
    padded = modes.padded_prefill(reference_models["llama"], prompt_ids)
    packed = modes.prepack_prefill(reference_models["llama"], prompt_ids)
    assert padded.num_computed_tokens == len(lengths) * max(lengths)
    # FFD bins of the longest prompt's size: fewer rows than prompts, so less padding.
    assert packed.num_computed_tokens < padded.num_computed_tokens
    assert packed.padding_fraction < padded.padding_fraction
    assert 0.0 <= packed.padding_fraction < 1.0


@pytest.mark.parametrize("mode", ["padded", "prepack"])
def test_eager_attention_is_exact_too(prompt_ids, solo, mode) -> None:
    """`eager` adds a bool mask as 0/1; the modes must hand it an additive mask."""
    model = context_model("qwen2")
    model.set_attn_implementation("eager")
    result = modes.prefill(model, prompt_ids, mode)
    assert_matches_solo(result, solo["qwen2"])
    assert model.config._attn_implementation == "eager"


def test_engine_attention_is_restored(prompt_ids, solo) -> None:
    """The engine's model runs `raypack_paged`; a mode call switches to sdpa and back."""
    model = context_model("llama")
    attention.register()
    model.set_attn_implementation(attention.ATTN_NAME)
    assert_matches_solo(modes.prefill(model, prompt_ids, "prepack"), solo["llama"])
    assert model.config._attn_implementation == attention.ATTN_NAME


def test_write_kv_fills_the_request_blocks(reference_models, prompt_ids) -> None:
    model = reference_models["mistral"]
    num_layers, kv_heads, head_dim = model_geometry(model)
    block_size = 4
    caches = allocate_kv_tensors(
        num_layers, 64, block_size, kv_heads, head_dim, torch.float32, "cpu"
    )
    chosen = [prompt_ids[i] for i in (0, 5, 7)]  # 83, 20 and 1 tokens
    result = modes.prepack_prefill(model, chosen)
    # Scattered, non-contiguous block tables, as the pool hands them out.
    free = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    tables = []
    for kv, ids in zip(result.kv, chosen, strict=True):
        table = [free.pop() for _ in range(-(-len(ids) // block_size))]
        modes.write_kv(caches, kv, table, block_size)
        tables.append(table)
    for kv, table, ids in zip(result.kv, tables, chosen, strict=True):
        for (k_cache, v_cache), (k, v) in zip(caches, kv, strict=True):
            for pos in (0, len(ids) // 2, len(ids) - 1):
                block, offset = table[pos // block_size], pos % block_size
                torch.testing.assert_close(k_cache[block, offset], k[:, pos], atol=0, rtol=0)
                torch.testing.assert_close(v_cache[block, offset], v[:, pos], atol=0, rtol=0)


def test_bad_inputs_are_value_errors(reference_models, prompt_ids) -> None:
    model = reference_models["llama"]
    with pytest.raises(ValueError, match="capacity 3 is shorter than the longest prompt"):
        modes.prepack_prefill(model, prompt_ids, capacity=3)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        modes.padded_prefill(model, [[5, 6], []])
    with pytest.raises(ValueError, match="at least one prompt"):
        modes.prepack_prefill(model, [])
    with pytest.raises(ValueError, match="padding_side must be 'left' or 'right'"):
        modes.padded_prefill(model, prompt_ids, padding_side="middle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode must be 'padded' or 'prepack'"):
        modes.prefill(model, prompt_ids, "varlen")  # type: ignore[arg-type]


# ---- the embedded SmolLM2 on real chat prompts (slow) -------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2")


@pytest.fixture(scope="module")
def chat_ids(tokenizer) -> list[list[int]]:
    """Six chat-templated HH-RLHF requests (the template's system prompt is a shared prefix)."""
    ids = []
    for request in sample_prompts(6, start=20):
        messages = [{"role": "user", "content": request}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids.append(tokenizer.encode(text, add_special_tokens=False))
    return ids


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_prepack_logits_and_kv_equal_solo(smollm2, chat_ids) -> None:
    result = modes.prepack_prefill(smollm2, chat_ids, capacity=2 * max(map(len, chat_ids)))
    assert result.num_computed_tokens < len(chat_ids) * max(map(len, chat_ids))  # really packed
    with torch.inference_mode():
        for i, ids in enumerate(chat_ids):
            solo = smollm2(torch.tensor([ids]), use_cache=True)
            torch.testing.assert_close(result.logits[i], solo.logits[0, -1], atol=1e-4, rtol=0)
            for (k, v), layer in zip(result.kv[i], solo.past_key_values.layers, strict=True):
                torch.testing.assert_close(k, layer.keys[0], atol=1e-4, rtol=0)
                torch.testing.assert_close(v, layer.values[0], atol=1e-4, rtol=0)
