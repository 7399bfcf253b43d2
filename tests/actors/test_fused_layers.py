"""Fused projections (actors/fused_linear.py) and the one-pass rotary attention
(actors/rotary_attention.py): the same numbers as the unfused layers, one packed weight per
group (no third copy), a per-module fallback, and greedy tokens as Hugging Face's."""

from __future__ import annotations

import pytest
import torch

from actors import SamplingParams, cpu_linear, llama_layer, rotary_attention
from actors.fused_linear import FusedProjection
from tests.actors.reference import assert_greedy_match, hf_greedy
from tests.cpu_marks import PACKED_BF16
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.skipif(
    not cpu_linear.onednn_available(), reason="torch was built without oneDNN"
)


def _groups(model: torch.nn.Module) -> list[FusedProjection]:
    found = {
        id(g): g
        for m in model.modules()
        if isinstance(g := getattr(m, "_raypack_packed", None), FusedProjection)
    }
    return list(found.values())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_fused_members_give_what_each_packed_linear_gives(arch) -> None:
    model = tiny_model(arch)
    attn = model.model.layers[0].self_attn
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(1, 7, attn.q_proj.in_features)
    cpu_linear.pack_linears(model, fuse=False)
    alone = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    cpu_linear.unpack_linears(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert cpu_linear.pack_linears(model, fuse=True) == len(linears)
    layers = len(model.model.layers)
    assert len(_groups(model)) == layers  # q/k/v in every layer
    # one packed tensor per group: its members hold no packed copy of their own
    assert not any(
        isinstance(getattr(m, "_raypack_packed", None), torch.Tensor)
        for m in linears
        if m in [attn.q_proj, attn.k_proj, attn.v_proj]
    )
    got = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    for a, b in zip(got, alone, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # out of order, twice, and on another input: each member still gets its own output
    other = torch.randn(1, 3, attn.q_proj.in_features)
    torch.testing.assert_close(attn.v_proj(x), alone[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attn.v_proj(x), alone[2], rtol=1e-5, atol=1e-5)
    expected_k = torch.nn.functional.linear(other, attn.k_proj.weight, attn.k_proj.bias)
    torch.testing.assert_close(attn.k_proj(other), expected_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attn.q_proj(x), alone[0], rtol=1e-5, atol=1e-5)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    cpu_linear.unpack_linears(model)
    assert not _groups(model)
    torch.testing.assert_close(
        attn.q_proj(x), torch.nn.functional.linear(x, attn.q_proj.weight, attn.q_proj.bias)
    )


def test_a_group_that_cannot_share_one_matmul_stays_single_linears() -> None:
    model = tiny_model("llama", num_layers=3)
    attn = model.model.layers[0].self_attn
    attn.k_proj.bias = torch.nn.Parameter(torch.zeros(attn.k_proj.out_features))  # k alone
    other = model.model.layers[1].self_attn
    other.v_proj = other.v_proj.to(torch.float64)
    cpu_linear.pack_linears(model, fuse=True)
    for m in (attn.q_proj, attn.k_proj, attn.v_proj, other.q_proj, other.k_proj):
        assert isinstance(m._raypack_packed, torch.Tensor)  # packed alone
    assert not hasattr(other.v_proj, "_raypack_packed")  # float64: not packed at all
    assert len(_groups(model)) == 1  # the third layer's
    assert rotary_attention.install(model) == 1


@torch.inference_mode()
def test_one_pass_rotary_is_bit_identical_to_transformers_rotary() -> None:
    model = tiny_model("llama", num_layers=3)
    ids = torch.randint(0, 49152, (1, 23), generator=torch.Generator().manual_seed(0))
    cpu_linear.pack_linears(model, fuse=True)
    expected = model(ids).logits
    assert rotary_attention.install(model) == 3
    assert torch.equal(model(ids).logits, expected)
    rotary_attention.uninstall(model)
    assert not any(hasattr(m, "_raypack_rotary") for m in model.modules())


def test_rotary_forward_only_where_the_forward_is_llamas() -> None:
    for arch, expected in (("llama", 2), ("qwen2", 0), ("mistral", 0)):
        model = tiny_model(arch)
        assert rotary_attention.install(model) == 0  # q/k/v not fused yet
        cpu_linear.pack_linears(model, fuse=True)
        assert rotary_attention.install(model) == expected, arch


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("fused", [True, False])
def test_greedy_matches_hf_fused_or_not(
    make_engine, tokenizer, reference_models, arch, fused
) -> None:
    prompts = ["Hello there, how are you doing today?", "The capital of France is", "x"]
    engine = make_engine(arch, chunk_size=7, linear_backend="onednn", fused_layers=fused)
    assert bool(_groups(engine.model)) == fused
    rotated = any(hasattr(m, "_raypack_rotary") for m in engine.model.modules())
    assert rotated == (fused and arch == "llama")
    one_function = any(hasattr(m, "_raypack_layer") for m in engine.model.modules())
    assert one_function == (fused and arch == "llama")
    outs = engine.generate(prompts, SamplingParams(max_tokens=12))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        expected = hf_greedy(reference_models[arch], ids, 12)
        assert_greedy_match(reference_models[arch], ids, out.token_ids, expected)


def test_a_later_engine_runs_the_model_as_its_own_config_says(make_engine) -> None:
    engine = make_engine("llama", linear_backend="onednn", fused_layers=True)
    model = engine.model
    from actors import EngineConfig, LLMEngine

    plain = LLMEngine(
        EngineConfig(num_kv_blocks=64, fused_layers=False), model=model, tokenizer=engine.tokenizer
    )
    assert not _groups(model) and not any(hasattr(m, "_raypack_rotary") for m in model.modules())
    assert plain.runner.linear_backend == "onednn"
    LLMEngine(
        EngineConfig(num_kv_blocks=64, linear_backend="torch"),
        model=model,
        tokenizer=engine.tokenizer,
    )
    assert not any(hasattr(m, "_raypack_packed") for m in model.modules())


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, PACKED_BF16])
def test_one_function_llama_layer_is_bit_identical_and_only_where_all_is_llamas(dtype) -> None:
    model = tiny_model("llama", num_layers=3).to(dtype)
    ids = torch.randint(0, 49152, (1, 23), generator=torch.Generator().manual_seed(1))
    assert llama_layer.install(model) == 0  # attention not on the one-pass rotary forward
    cpu_linear.pack_linears(model, fuse=True)
    rotary_attention.install(model)
    expected = model(ids).logits
    model.model.layers[1].mlp.register_forward_hook(lambda *args: None)  # hooked: left alone
    assert llama_layer.install(model) == 2
    assert not hasattr(model.model.layers[1], "_raypack_layer")
    assert torch.equal(model(ids).logits, expected)
    llama_layer.uninstall(model)
    assert not any(hasattr(m, "_raypack_layer") for m in model.modules())
    assert torch.equal(model(ids).logits, expected)
