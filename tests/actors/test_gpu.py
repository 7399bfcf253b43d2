"""The CUDA paths: flash varlen attention (bf16) against the SDPA path, and the engine on a GPU.

The `gpu`-marked tests are skipped without CUDA (tests/conftest.py); one CPU test checks the
varlen path's inputs (key gathering, cu_seqlens) with a plain-torch stand-in for the kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors import EngineConfig, LLMEngine, SamplingParams
from actors.attention import build_metadata, paged_attention
from packing.layout import flat_layout, slot_mapping
from tests.actors.conftest import context_model
from tests.actors.groups import prefix_groups_for, shared_prefix_prompts
from tests.actors.reference import assert_greedy_match, hf_greedy


class _Layer(torch.nn.Module):
    layer_idx = 0


def _attend(device: str, dtype: torch.dtype, use_varlen: bool, data: dict) -> torch.Tensor:
    """Run paged_attention on one mixed step: two decodes, a cached extend, a fresh prefill."""
    block_size = 16
    num_cached, num_new = np.array([20, 33, 16, 0]), np.array([1, 1, 9, 17])
    tables = [[0, 1], [2, 3, 4], [5, 6], [7, 8]]
    k_cache = data["k_cache"].to(device, dtype).clone()  # [blocks, block_size, kv_heads, dim]
    v_cache = data["v_cache"].to(device, dtype).clone()
    layout = flat_layout(num_cached, num_new)
    slots = slot_mapping(num_cached, num_new, tables, block_size)
    meta = build_metadata(
        [(k_cache, v_cache)],
        num_cached,
        num_new,
        tables,
        slots,
        layout.cu_seqlens_q,
        block_size,
        2,
        torch.device(device),
        use_varlen=use_varlen,
    )
    q, k, v = (data[n].to(device, dtype) for n in ("q", "k", "v"))
    out, _ = paged_attention(_Layer(), q, k, v, None, scaling=0.125, raypack_attention=meta)
    return out.float().cpu()  # [1, tokens, heads, dim]


def _step_data() -> dict:
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim = 28, 6, 2, 64
    return {
        "q": torch.randn(1, heads, tokens, dim, generator=gen),
        "k": torch.randn(1, kv_heads, tokens, dim, generator=gen),
        "v": torch.randn(1, kv_heads, tokens, dim, generator=gen),
        "k_cache": torch.randn(9, 16, kv_heads, dim, generator=gen),
        "v_cache": torch.randn(9, 16, kv_heads, dim, generator=gen),
    }


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
    """Flash varlen semantics in plain torch: causal masks aligned bottom-right."""
    assert window_size == (-1, 0) and enable_gqa
    out = torch.empty_like(q)  # [tokens, heads, dim]
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        rows = (ke - ks) - (qe - qs) + torch.arange(qe - qs)
        mask = torch.arange(ke - ks)[None, :] <= rows[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1),
            k[ks:ke].transpose(0, 1),
            v[ks:ke].transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[qs:qe] = o.transpose(0, 1)
    return out


def test_varlen_inputs_match_the_sdpa_path_on_cpu(monkeypatch) -> None:
    from torch.nn.attention import varlen

    monkeypatch.setattr(varlen, "varlen_attn", _reference_varlen)
    data = _step_data()
    expected = _attend("cpu", torch.float32, False, data)
    torch.testing.assert_close(_attend("cpu", torch.float32, True, data), expected)


@pytest.mark.gpu
def test_varlen_attention_matches_the_sdpa_path() -> None:
    data = _step_data()
    expected = _attend("cpu", torch.float32, False, data)
    sdpa_cuda = _attend("cuda", torch.float32, False, data)
    varlen = _attend("cuda", torch.bfloat16, True, data)
    torch.testing.assert_close(sdpa_cuda, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(varlen, expected, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_engine_on_cuda_matches_hf_generate(tokenizer, dtype) -> None:
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in shared_prefix_prompts()]
    reference = context_model("llama").to("cuda", dtype)
    model = context_model("llama").to("cuda", dtype)
    engine = LLMEngine(
        EngineConfig(num_kv_blocks=256, chunk_size=16), model=model, tokenizer=tokenizer
    )
    assert engine.runner.use_varlen == (dtype != torch.float32)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=12), prefix_groups_for(prompts))
    # bf16 rounding moves logits by ~1e-2, so only fp32 keeps the strict tie threshold.
    tie_gap = 1e-4 if dtype == torch.float32 else 0.1
    for ids, out in zip(prompts, outputs, strict=True):
        expected = hf_greedy(reference, ids, 12)
        assert_greedy_match(reference, ids, out.token_ids, expected, tie_gap=tie_gap)
