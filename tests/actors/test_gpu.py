"""The CUDA paths: flash varlen attention (bf16) against the SDPA path, and the engine on a GPU.

The `gpu`-marked tests are skipped without CUDA (tests/conftest.py); on CPU,
tests/actors/test_attention_backends.py checks the varlen backend's inputs (key gathering,
cu_seqlens) with a plain-torch stand-in for the kernel.
"""

from __future__ import annotations

import pytest
import torch

from actors import EngineConfig, LLMEngine, SamplingParams
from actors.attention import make_backend
from actors.attention.varlen import VarlenBackend
from tests.actors.attention_step import attend, make_step
from tests.actors.conftest import context_model
from tests.actors.groups import prefix_groups_for, shared_prefix_prompts
from tests.actors.reference import assert_greedy_match, hf_greedy


def sdpa(caches):
    return make_backend("sdpa", caches)


@pytest.mark.gpu
def test_varlen_attention_matches_the_sdpa_path() -> None:
    step = make_step()
    expected = attend(sdpa, step)
    sdpa_cuda = attend(sdpa, step, "cuda", torch.float32)
    varlen = attend(VarlenBackend, step, "cuda", torch.bfloat16)
    torch.testing.assert_close(sdpa_cuda, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(varlen, expected, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_engine_on_cuda_matches_hf_generate(tokenizer, dtype) -> None:
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in shared_prefix_prompts()]
    reference = context_model("llama").to("cuda", dtype)
    model = context_model("llama").to("cuda", dtype)
    engine = LLMEngine(
        EngineConfig(dtype="float32", num_kv_blocks=256, chunk_size=16),
        model=model,
        tokenizer=tokenizer,
    )
    varlen = isinstance(engine.runner.attention_backend, VarlenBackend)
    assert varlen == (dtype != torch.float32)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=12), prefix_groups_for(prompts))
    # bf16 rounding moves logits by ~1e-2, so only fp32 keeps the strict tie threshold.
    tie_gap = 1e-4 if dtype == torch.float32 else 0.1
    for ids, out in zip(prompts, outputs, strict=True):
        expected = hf_greedy(reference, ids, 12)
        assert_greedy_match(reference, ids, out.token_ids, expected, tie_gap=tie_gap)
