"""The compiled element-wise kernels (actors/kernels/fused.py): residual add + RMSNorm and the
q/k rotary give transformers' own modules' results bit for bit, in float32 and bfloat16, and
the one-function Llama layers using them stay bit-identical to transformers' layers."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from actors import (
    EngineConfig,
    LLMEngine,
    SamplingParams,
    cpu_linear,
    llama_layer,
    rotary_attention,
)
from actors.kernels.fused import fused_ops
from tests.cpu_marks import PACKED_BF16, needs_onednn_bf16
from tests.tiny_models import tiny_model

DTYPES = [torch.float32, torch.bfloat16]


def _ops(dtype: torch.dtype):
    ops = fused_ops("cpu", dtype)
    if ops is None:
        pytest.skip("no C compiler: the layers keep torch's ops")
    return ops


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES)
# 576: SmolLM2; 4100: a tail past whole vectors and cascade levels; 12: shorter than a vector
@pytest.mark.parametrize(("rows", "width"), [(300, 576), (3, 4100), (5, 12)])
def test_add_and_norm_are_transformers_norm_bit_for_bit(dtype, rows, width) -> None:
    ops = _ops(dtype)
    generator = torch.Generator().manual_seed(width)
    norm = LlamaRMSNorm(width, eps=1e-5).to(dtype)
    norm.weight.copy_(torch.randn(width, generator=generator))
    x = (torch.randn(rows, width, generator=generator) * 7).to(dtype)
    residual = torch.randn(rows, width, generator=generator).to(dtype)
    lanes = ops.norm_lanes(width, 1e-5)
    assert lanes is not None  # this torch's sum order is found: the fused norm is used
    expected_sum = x + residual
    got = ops.rms_norm(x, norm.weight, 1e-5, lanes, residual)
    assert torch.equal(x, expected_sum)  # x now holds the residual stream
    assert torch.equal(got, norm(expected_sum))
    assert torch.equal(ops.rms_norm(x.clone(), norm.weight, 1e-5, lanes), norm(x))


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 175])
def test_rotary_in_place_is_transformers_rotary_bit_for_bit(dtype, tokens) -> None:
    ops = _ops(dtype)
    generator = torch.Generator().manual_seed(tokens)
    q_heads, k_heads, v_heads, head_dim = 9, 3, 3, 64
    qkv = torch.randn(1, tokens, (q_heads + k_heads + v_heads) * head_dim, generator=generator)
    qkv = qkv.to(dtype)
    cos = torch.randn(1, tokens, head_dim, generator=generator).to(dtype)
    sin = torch.randn(1, tokens, head_dim, generator=generator).to(dtype)

    def heads(t: torch.Tensor, first: int, count: int) -> torch.Tensor:
        part = t[..., first * head_dim : (first + count) * head_dim]
        return part.reshape(1, tokens, count, head_dim).transpose(1, 2)

    q, k = apply_rotary_pos_emb(heads(qkv, 0, q_heads), heads(qkv, q_heads, k_heads), cos, sin)
    got = qkv.clone()
    ops.rotary(got.view(tokens, -1), q_heads + k_heads, head_dim, cos, sin)
    assert torch.equal(heads(got, 0, q_heads), q)
    assert torch.equal(heads(got, q_heads, k_heads), k)
    assert torch.equal(heads(got, q_heads + k_heads, v_heads), heads(qkv, q_heads + k_heads, 3))


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, PACKED_BF16])  # packed linears
def test_layers_on_the_kernels_are_bit_identical_to_transformers_layers(dtype) -> None:
    ops = _ops(dtype)
    model = tiny_model("llama", num_layers=3).to(dtype)
    generator = torch.Generator().manual_seed(2)
    for module in model.modules():  # norm weights away from their initial ones
        if isinstance(module, LlamaRMSNorm):
            module.weight.copy_(1 + torch.randn(module.weight.shape, generator=generator) / 4)
    ids = torch.randint(0, 49152, (1, 41), generator=generator)
    cpu_linear.pack_linears(model, fuse=True)
    expected = model(ids).logits
    assert rotary_attention.install(model, ops) == 3
    assert llama_layer.install(model, ops) == 3
    assert ops.norm_lanes(model.config.hidden_size, model.config.rms_norm_eps) is not None
    assert torch.equal(model(ids).logits, expected)


def test_no_kernels_for_other_dtypes_or_devices() -> None:
    assert fused_ops("cpu", torch.float16) is None
    assert fused_ops("meta", torch.float32) is None


@torch.inference_mode()
def test_a_norm_whose_dtype_is_not_the_kernels_keeps_torchs_ops() -> None:
    """A float32 model handed bfloat16 kernels (as a mixed model would be) runs its norms
    and rotary as torch's ops: the same logits as transformers'."""
    ops = _ops(torch.bfloat16)
    model = tiny_model("llama", num_layers=2)
    ids = torch.randint(0, 49152, (1, 9), generator=torch.Generator().manual_seed(3))
    cpu_linear.pack_linears(model, fuse=True)
    expected = model(ids).logits
    rotary_attention.install(model, ops)
    llama_layer.install(model, ops)
    assert torch.equal(model(ids).logits, expected)


@pytest.mark.parametrize("rows", [1, 175])
def test_bfloat16_argmax_is_torchs_on_the_float32_copy(rows) -> None:
    ops = _ops(torch.bfloat16)
    generator = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, 1000, generator=generator).to(torch.bfloat16)
    logits[0, 7] = logits[0, 900] = 50.0  # a tie: the first wins
    if rows > 2:
        logits[1, 500] = logits[1, 3] = float("nan")  # the first NaN, as torch's argmax
        logits[2] = float("-inf")
    assert torch.equal(ops.argmax(logits), logits.float().argmax(-1))
    wider = torch.randn(rows, 1200, generator=generator).to(torch.bfloat16)
    assert torch.equal(ops.argmax(wider[:, 100:1100]), wider[:, 100:1100].float().argmax(-1))
    assert ops.argmax(logits.float()) is None


def test_bfloat16_argmax_orders_every_bit_pattern_as_torch() -> None:
    """Every bf16 bit pattern that is not a NaN (signed zeros, subnormals, infinities), in two
    rows in random order; then rows whose largest value is negative or a zero of either sign,
    ties across the kernel's blocks, and a negative NaN."""
    ops = _ops(torch.bfloat16)
    generator = torch.Generator().manual_seed(5)
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    finite = bits[~bits.view(torch.bfloat16).isnan()]  # 65,282 patterns
    every = finite[torch.randperm(finite.numel(), generator=generator)].view(torch.bfloat16)
    logits = torch.cat([every.view(2, -1), every.view(2, -1)[:1].repeat(5, 1)])
    logits[2] = -logits[2].abs()  # all negative
    logits[3] = -logits[3].abs()
    logits[3, 300] = -0.0
    logits[3, 4000] = 0.0  # equal to -0.0: the first one wins
    logits[4, 17] = logits[4, 30000] = float("inf")
    logits[5, 600] = torch.tensor(-(2**15) | 0x7FC0, dtype=torch.int16).view(torch.bfloat16)
    logits[6] = -(2**-130)  # one negative subnormal everywhere: index 0
    assert torch.equal(ops.argmax(logits), logits.float().argmax(-1))


@needs_onednn_bf16
def test_bfloat16_engine_greedy_steps_take_the_kernel_argmax_same_tokens(tokenizer) -> None:
    _ops(torch.bfloat16)
    prompts = ["Hello there, how are you doing today?", "The capital of France is", "x"]
    tokens = {}
    for kernels in (True, False):
        config = EngineConfig(num_kv_blocks=64, linear_backend="onednn", fused_kernels=kernels)
        model = tiny_model("llama", num_layers=2).to(torch.bfloat16)
        engine = LLMEngine(config, model=model, tokenizer=tokenizer)
        assert (engine.runner.greedy_argmax is not None) == kernels
        outs = engine.generate(prompts, SamplingParams(max_tokens=10))
        tokens[kernels] = [list(o.token_ids) for o in outs]
    assert tokens[True] == tokens[False]
