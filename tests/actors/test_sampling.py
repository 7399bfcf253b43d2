"""Sampling: seeds, top-k/top-p support, stop strings and ids, min_tokens, logprobs, errors."""

from __future__ import annotations

import math

import pytest
import torch

from actors import SamplingParams
from actors.request import Request
from actors.sampler import Sampler, apply_top_k_top_p

PROMPTS = ["Tell me a story about a dragon.", "List three colours.", "Why is the sky blue?"]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(make_engine) -> None:
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    other = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, ignore_eos=True)
    alone = make_engine().generate([PROMPTS[0]], seeded)[0]
    batched = make_engine().generate(PROMPTS, [seeded, other, other])[0]
    assert alone.token_ids == batched.token_ids
    reseeded = make_engine().generate([PROMPTS[0]], SamplingParams(**{**_kw(seeded), "seed": 8}))
    assert reseeded[0].token_ids != alone.token_ids


def _kw(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__dataclass_fields__}


def test_top_k_and_top_p_restrict_the_support() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]])
    logits = probs.log()
    kept = apply_top_k_top_p(logits, torch.tensor([2, 4]), torch.tensor([1.0, 0.7]))
    assert torch.isfinite(kept).tolist() == [[True, True, False, False], [False, False, True, True]]
    # Sampling many times only ever returns tokens inside the filters.
    sampler = Sampler(eos_token_ids=[], seed=0)
    reqs = [
        _request(SamplingParams(temperature=1.0, top_k=2)),
        _request(SamplingParams(temperature=1.0, top_p=0.7)),
        _request(SamplingParams(temperature=1.0, top_k=3, top_p=0.6)),
    ]
    seen: list[set[int]] = [set(), set(), set()]
    for _ in range(300):
        out = sampler(torch.stack([logits[0], logits[1], logits[0]]), reqs)
        for row, token in enumerate(out.token_ids):
            seen[row].add(token)
    assert seen == [{0, 1}, {2, 3}, {0, 1}]


def _request(params: SamplingParams, prompt: list[int] | None = None) -> Request:
    return Request("r", prompt or [1, 2, 3], params)


def test_greedy_rows_take_the_argmax_and_min_tokens_masks_eos() -> None:
    sampler = Sampler(eos_token_ids=[2])
    logits = torch.tensor([[0.0, 1.0, 5.0, 3.0]])
    assert sampler(logits.clone(), [_request(SamplingParams())]).token_ids == [2]
    held = _request(SamplingParams(min_tokens=1, stop_token_ids=(3,)))
    assert sampler(logits.clone(), [held]).token_ids == [1]  # EOS and stop id 3 masked
    free = _request(SamplingParams(min_tokens=1, ignore_eos=True))
    assert sampler(logits.clone(), [free]).token_ids == [2]  # ignore_eos: EOS is a token


def test_stop_string_is_cut_from_the_text(make_engine) -> None:
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    full = make_engine().generate([PROMPTS[1]], params)[0]
    assert len(full.text) > 10
    stop = full.text[6:9]
    start = full.text.find(stop)
    cut = make_engine().generate([PROMPTS[1]], SamplingParams(**{**_kw(params), "stop": stop}))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:start]
    assert full.token_ids[: len(cut.token_ids)] == cut.token_ids


def test_stop_token_ids_and_min_tokens(make_engine) -> None:
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    full = make_engine().generate([PROMPTS[2]], params)[0]
    third = full.token_ids[2]
    stopped = make_engine().generate(
        [PROMPTS[2]], SamplingParams(**{**_kw(params), "stop_token_ids": (third,)})
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[: full.token_ids.index(third) + 1]
    first = full.token_ids[0]
    held = make_engine().generate(
        [PROMPTS[2]],
        SamplingParams(**{**_kw(params), "stop_token_ids": (first,), "min_tokens": 1}),
    )[0]
    assert held.token_ids[0] != first  # masked until one token exists


def test_logprobs_shape_and_values(make_engine) -> None:
    out = make_engine().generate([PROMPTS[0]], SamplingParams(max_tokens=5, logprobs=3))[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token and len(lp.top) == 3
        assert lp.top[0] == (token, pytest.approx(lp.logprob))  # greedy: the best one
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert all(v <= 0 for _, v in lp.top) and math.isfinite(lp.logprob)
    none = make_engine().generate([PROMPTS[0]], SamplingParams(max_tokens=2))[0]
    assert none.logprobs is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_generate_arguments_are_value_errors(make_engine) -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate(PROMPTS, [SamplingParams()])
    from tests.actors.groups import PrefixGroup

    with pytest.raises(ValueError, match="do not all start with the same"):
        engine.generate(PROMPTS, prefix_groups=[PrefixGroup(prefix_len=3, members=(0, 1))])
    with pytest.raises(ValueError, match="not a prompt index"):
        engine.generate(PROMPTS, prefix_groups=[PrefixGroup(prefix_len=1, members=(0, 9))])
    engine.add_request("x", request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("y", request_id="dup")


def test_bad_prompts_become_error_outputs_and_the_batch_finishes(make_engine) -> None:
    engine = make_engine(max_model_len=64)
    too_long = " ".join(["word"] * 200)
    outs = engine.generate([PROMPTS[0], too_long, "", [10**9], PROMPTS[1]])
    assert [o.finish_reason for o in outs][1:4] == ["error"] * 3
    assert "max_model_len=64" in (outs[1].error or "")
    assert "empty" in (outs[2].error or "") and "vocabulary" in (outs[3].error or "")
    for ok in (outs[0], outs[4]):
        assert ok.finished and ok.error is None and ok.token_ids


def test_generation_stops_at_the_context_end(make_engine) -> None:
    engine = make_engine(max_model_len=24)
    out = engine.generate([[5] * 20], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_abort_frees_blocks_and_reports(make_engine) -> None:
    engine = make_engine(num_kv_blocks=64, enable_prefix_caching=False)
    keep = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=6))
    drop = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request(drop)
    engine.abort_request("no-such-request")  # ignored
    finals = {}
    while engine.has_unfinished():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finals[drop].finish_reason == "abort" and len(finals[drop].token_ids) == 1
    assert finals[keep].finished and finals[keep].finish_reason in ("stop", "length")
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "seed",
            2**64,
            r"seed must be an integer in \[-9223372036854775808, 18446744073709551615\]",
        ),
        ("seed", -(2**63) - 1, "seed must be an integer"),
        ("top_k", 2**63, r"top_k must be an integer in \[-1, 2147483647\]"),
        ("temperature", float("nan"), "temperature must be a finite number"),
        ("temperature", float("inf"), "temperature must be a finite number"),
        ("temperature", 1e30, r"temperature must be a finite number in \[0.0, 10000.0\]"),
        ("top_p", float("nan"), "top_p must be a finite number"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
        ("max_tokens", True, "max_tokens must be an integer"),
        ("max_tokens", 2**40, "max_tokens must be an integer"),
        ("logprobs", 10**6, r"logprobs must be an integer in \[0, 20\]"),
        ("stop_token_ids", (2**40,), "stop_token_ids must be integers"),
        ("temperature", "0.5", "temperature must be a finite number"),
    ],
)
def test_sampling_params_bound_every_value_and_name_it(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_values_below_float32_resolution_are_what_they_are():
    # 1e-300 is 0 in float32: such a temperature is greedy, such a top_p keeps the best token.
    assert SamplingParams(temperature=1e-300).greedy
    assert SamplingParams(temperature=1e-300, top_p=1e-300).top_p > 0
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
