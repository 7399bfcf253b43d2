"""The bfloat16-screened LM head (actors/screened_head.py): its error bound holds, its argmax
is the float32 argmax (near-ties, exact ties, huge rows, degenerate rows), and an engine
gives the same tokens with it as without it and as Hugging Face's `generate`."""

from __future__ import annotations

import pytest
import torch

from actors import SamplingParams, cpu_linear
from actors.agreement import teacher_forced
from actors.dtypes import CpuInfo
from actors.screened_head import MAX_CANDIDATES, ScreenedHead, row_norm_maxima, wanted
from tests.actors.reference import assert_greedy_match, hf_greedy
from tests.cpu_marks import ONEDNN_BF16, needs_onednn_bf16
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.skipif(
    not cpu_linear.onednn_available(), reason="torch was built without oneDNN"
)
U_BF16 = 2.0**-8


def _head(vocab: int = 6000, k: int = 96, seed: int = 0) -> torch.nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(k, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, k, generator=gen) * 0.3)
    return head


def _hidden(rows: int, k: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * scale


@needs_onednn_bf16
@torch.inference_mode()
@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0, 1e4])
def test_the_bound_holds_for_every_token(scale) -> None:
    head = _head()
    screened = ScreenedHead(head)
    hidden = _hidden(40, 96, seed=1, scale=scale)
    h_b = hidden.to(torch.bfloat16)
    y = torch.ops.mkldnn._linear_pointwise(h_b, screened.packed, None, "none", [], "")
    y64 = y.double()
    bound = screened.error_bound(hidden, h_b)[:, None] + U_BF16 * y64.abs()
    for reference in (head(hidden), hidden.double() @ head.weight.double().T):
        err = (y64 - reference.double()).abs()
        assert bool((err <= bound).all())
    # and not vacuous: its largest value within 10x of the largest error (~4x measured)
    assert float(bound.max() / (y64 - head(hidden).double()).abs().max()) < 10


@torch.inference_mode()
@pytest.mark.parametrize("chunk_rows", [7, 4096, 10_000])
def test_the_heads_norms_by_chunks_are_the_whole_heads(chunk_rows) -> None:
    weight = _head().weight.detach()  # 6,000 rows: chunks of 7 and 4,096 leave a remainder
    weight[5999] *= 50  # the largest rows in the last chunk
    w_b = weight.to(torch.bfloat16)
    w64, wb64 = weight.double(), w_b.double()
    whole = (wb64.norm(dim=1).max(), (wb64 - w64).norm(dim=1).max(), w64.norm(dim=1).max())
    got = row_norm_maxima(weight, w_b, chunk_rows)
    assert got == pytest.approx([float(v) for v in whole], rel=1e-12)
    assert got[0] > 50 * float(wb64[:5999].norm(dim=1).max()) / 2


@needs_onednn_bf16
@torch.inference_mode()
def test_screened_argmax_is_the_float32_argmax_on_random_rows() -> None:
    for seed in range(3):
        head = _head(seed=seed)
        screened = ScreenedHead(head)
        hidden = _hidden(64, 96, seed=10 + seed)
        assert torch.equal(screened.argmax(hidden), head(hidden).argmax(dim=-1))
    assert screened.stats.fallback_rows == 0 and screened.stats.candidates > 0


@needs_onednn_bf16
@torch.inference_mode()
def test_near_ties_that_bfloat16_cannot_see_are_decided_in_float32() -> None:
    head = _head()
    hidden = _hidden(6, 96, seed=3)
    w = head.weight.detach()
    best = head(hidden).argmax(dim=-1)
    for row in range(6):  # per row, a token a hair better or a hair worse than its best
        nudge = hidden[row] / hidden[row].norm() * 1e-3 * (1 if row % 2 else -1)
        w[100 + row] = w[best[row]] + nudge
    # an exact tie: the lowest index wins, as torch.argmax
    w[5000] = w[best[0]]
    # the winner in the last, short block of the candidate search (6000 = 23 x 256 + 112)
    w[5999] = w[best[2]] + hidden[2] / hidden[2].norm() * 2e-3
    full = head(hidden)
    gap = (full[torch.arange(6), 100 + torch.arange(6)] - full[torch.arange(6), best]).abs()
    top = full[torch.arange(6), best].abs()
    assert bool((gap > 1e-5).all()) and bool((gap < U_BF16 * top).all())  # under bf16's ulp
    screened = ScreenedHead(head)
    got = screened.argmax(hidden)
    assert torch.equal(got, full.argmax(dim=-1))
    assert got.tolist()[1::2] == [101, 103, 105]
    assert got[0] == min(int(best[0]), 5000)
    assert got[2] == 5999


@needs_onednn_bf16
@torch.inference_mode()
def test_huge_rows_degenerate_and_non_finite_rows_fall_back_or_win() -> None:
    head = _head()
    with torch.no_grad():
        head.weight[77] *= 1e4  # one huge row: a wide bound, still an exact answer
    hidden = _hidden(8, 96, seed=4)
    hidden[5] = 0.0  # every logit 0: all tokens candidates -> the full float32 row
    hidden[6, 3] = float("nan")
    screened = ScreenedHead(head)
    got = screened.argmax(hidden)
    expected = head(hidden).argmax(dim=-1)
    assert torch.equal(got, expected)
    assert got[5] == 0
    assert screened.stats.fallback_rows >= 2
    assert head.weight.shape[0] > MAX_CANDIDATES


def test_auto_screens_float32_on_a_cpu_with_native_bf16_only() -> None:
    model = tiny_model("llama")
    cpu = torch.device("cpu")
    native = CpuInfo("x", frozenset({"avx512_bf16"}))
    plain = CpuInfo("x", frozenset({"avx2"}))
    # the screen runs where oneDNN runs bfloat16 (this machine's CPU), whatever `cpu` says
    assert wanted("auto", model, cpu, torch.float32, native) == ONEDNN_BF16
    assert not wanted("auto", model, cpu, torch.float32, plain)
    assert not wanted("auto", model, cpu, torch.bfloat16, native)
    assert wanted("on", model, cpu, torch.float32, plain) == ONEDNN_BF16
    assert not wanted("on", model, cpu, torch.bfloat16, native)
    assert not wanted("off", model, cpu, torch.float32, native)


PROMPTS = ["Hello there, how are you doing today?", "The capital of France is", "x"]


@needs_onednn_bf16
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_engine_tokens_with_screening_on_equal_off_and_hf(
    make_engine, tokenizer, reference_models, arch
) -> None:
    on = make_engine(arch, chunk_size=7, dtype="float32", lm_head_screen="on")
    off = make_engine(arch, chunk_size=7, dtype="float32", lm_head_screen="off")
    assert on.runner.screened_head is not None and off.runner.screened_head is None
    outs_on = on.generate(PROMPTS, SamplingParams(max_tokens=12))
    outs_off = off.generate(PROMPTS, SamplingParams(max_tokens=12))
    assert on.runner.screened_head.stats.steps > 0
    for prompt, a, b in zip(PROMPTS, outs_on, outs_off, strict=True):
        assert a.token_ids == b.token_ids
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        expected = hf_greedy(reference_models[arch], ids, 12)
        assert_greedy_match(reference_models[arch], ids, a.token_ids, expected)


@needs_onednn_bf16
def test_steps_mixing_greedy_sampled_and_logprob_rows_are_as_without_screening(
    make_engine,
) -> None:
    params = [
        SamplingParams(max_tokens=10, ignore_eos=True),
        SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=3),
        SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
    ]
    on = make_engine("llama", dtype="float32", lm_head_screen="on")
    off = make_engine("llama", dtype="float32", lm_head_screen="off")
    outs_on = on.generate(PROMPTS + ["y"], params)
    outs_off = off.generate(PROMPTS + ["y"], params)
    assert on.runner.screened_head.stats.steps == 0  # every step had a row needing logits
    for a, b in zip(outs_on, outs_off, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
    # min_tokens: full logits (EOS banned) until reached, screened after; same tokens
    eos_late = SamplingParams(max_tokens=10, min_tokens=6)
    a = on.generate(PROMPTS, eos_late)
    b = off.generate(PROMPTS, eos_late)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert on.runner.screened_head.stats.steps > 0


@needs_onednn_bf16
def test_teacher_forcing_reads_full_logits_on_a_screened_engine(make_engine, tokenizer) -> None:
    on = make_engine("llama", dtype="float32", lm_head_screen="on")
    off = make_engine("llama", dtype="float32", lm_head_screen="off")
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    targets = [[5, 6, 7], [8, 9], [10]]
    a, b = teacher_forced(on, prompts, targets), teacher_forced(off, prompts, targets)
    assert a.top1 == b.top1
    assert on.runner.screened_head is not None and on.runner.screened_head.stats.steps == 0
