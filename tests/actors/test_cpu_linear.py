"""The linear layers through oneDNN with packed weights (actors/cpu_linear.py): the same
results as torch's F.linear up to rounding, the model's own parameters untouched, greedy
tokens as Hugging Face's on both backends, and the choice undone for a later engine."""

from __future__ import annotations

import pytest
import torch

from actors import EngineConfig, LLMEngine, SamplingParams, cpu_linear
from tests.actors.reference import assert_greedy_match, hf_greedy
from tests.cpu_marks import ONEDNN_BF16, PACKED_BF16
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.skipif(
    not cpu_linear.onednn_available(), reason="torch was built without oneDNN"
)


@pytest.mark.parametrize("dtype", [torch.float32, PACKED_BF16])
def test_packed_linears_compute_what_f_linear_does(dtype) -> None:
    model = tiny_model("llama").to(dtype)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 5, linears[0].in_features).to(dtype)
    expected = [torch.nn.functional.linear(x, m.weight, m.bias) for m in linears[:1]]
    assert cpu_linear.pack_linears(model) == len(linears)
    assert cpu_linear.pack_linears(model) == 0  # packed once
    got = linears[0](x)
    assert got.shape == expected[0].shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected[0], rtol=tol, atol=tol)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    cpu_linear.unpack_linears(model)
    assert torch.equal(linears[0](x), expected[0])


@pytest.mark.parametrize("backend", ["onednn", "torch"])
def test_greedy_matches_hf_on_either_linear_backend(
    make_engine, tokenizer, reference_models, backend
) -> None:
    prompts = ["Hello there, how are you doing today?", "The capital of France is", "x"]
    engine = make_engine("llama", num_kv_blocks=64, chunk_size=7, linear_backend=backend)
    assert engine.runner.linear_backend == backend
    packed = [hasattr(m, "_raypack_packed") for m in engine.model.modules()]
    assert any(packed) == (backend == "onednn")
    outs = engine.generate(prompts, SamplingParams(max_tokens=12))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        expected = hf_greedy(reference_models["llama"], ids, 12)
        assert_greedy_match(reference_models["llama"], ids, out.token_ids, expected)


def test_auto_picks_onednn_on_cpu_and_a_bad_name_is_refused() -> None:
    cpu = torch.device("cpu")
    assert cpu_linear.resolve("auto", cpu, torch.float32) == "onednn"
    assert cpu_linear.resolve("auto", cpu, torch.float16) == "torch"
    assert cpu_linear.resolve("torch", cpu, torch.float32) == "torch"
    with pytest.raises(ValueError, match="onednn"):
        cpu_linear.resolve("onednn", torch.device("meta"), torch.float32)
    with pytest.raises(ValueError, match="linear_backend"):
        EngineConfig(linear_backend="mkl")  # type: ignore[arg-type]


def test_bfloat16_goes_to_onednn_only_where_the_cpu_runs_its_bfloat16_path(tokenizer) -> None:
    """On an AVX2-only CPU oneDNN refuses to pack a bfloat16 weight: the check says so before
    anything is packed, `auto` keeps torch's matmul there, and asking for oneDNN is refused."""
    cpu = torch.device("cpu")
    weight = torch.randn(64, 32).to(torch.bfloat16)
    try:
        torch.ops.mkldnn._reorder_linear_weight(weight, cpu_linear.BATCH_HINT)
        packs = True
    except RuntimeError:
        packs = False
    assert cpu_linear.onednn_runs(torch.bfloat16) == packs == ONEDNN_BF16
    assert cpu_linear.onednn_runs(torch.float32)
    expected = "onednn" if packs else "torch"
    assert cpu_linear.resolve("auto", cpu, torch.bfloat16) == expected
    if not packs:
        with pytest.raises(ValueError, match="AVX-512"):
            cpu_linear.resolve("onednn", cpu, torch.bfloat16)
    model = tiny_model("llama").to(torch.bfloat16)
    engine = LLMEngine(EngineConfig(num_kv_blocks=64), model=model, tokenizer=tokenizer)
    assert engine.runner.linear_backend == expected
    assert len(engine.generate(["Hello"], SamplingParams(max_tokens=3))[0].token_ids) == 3


def test_auto_keeps_torch_when_the_packed_copy_would_not_fit(caplog) -> None:
    cpu = torch.device("cpu")
    free = cpu_linear.free_memory_bytes()
    assert cpu_linear.resolve("auto", cpu, torch.float32, copy_bytes=free // 4) == "onednn"
    with caplog.at_level("WARNING", logger="actors.cpu_linear"):
        assert cpu_linear.resolve("auto", cpu, torch.float32, copy_bytes=free) == "torch"
    assert "more than half the free memory" in caplog.text
    assert cpu_linear.resolve("onednn", cpu, torch.float32, copy_bytes=free) == "onednn"
    model = tiny_model("llama")
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert cpu_linear.linear_weight_bytes(model) == sum(w.numel() * 4 for w in weights)
