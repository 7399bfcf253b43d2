"""Presence, frequency and repetition penalties, min_p and logit_bias, against first
principles: the reference runs the tiny context-sensitive model greedily one Hugging Face
forward pass per token and applies each adjustment by hand (plain Python over the token
counts), and the engine's tokens must equal it; repetition_penalty is also checked against
Hugging Face `generate(repetition_penalty=...)`, which implements the same formula.

The tiny model never repeats itself on its own (random weights, 49K tokens), so the visible
effects come from values that encourage repetition (negative presence/frequency, a
repetition penalty below 1) or from a logit_bias that makes one token win until a penalty
takes it down.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from actors import SamplingParams
from actors.penalties import apply_penalties
from actors.request import Request
from actors.sampler import Sampler
from tests.sampling_cases import penalised_greedy

PROMPTS = ["Tell me a story about a dragon.", "List three colours.", "Why is the sky blue?"]
MAX_TOKENS = 10
TIE_GAP = 1e-4  # adjusted top-2 gap below this is a floating-point tie, not an engine bug


@pytest.fixture
def prompt_ids(tokenizer) -> list[list[int]]:  # noqa: ANN001
    return [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


def assert_tokens(got: Sequence[int], expected: Sequence[int], gaps: Sequence[float]) -> None:
    """Equal, or parting only at a shown tie of the reference's adjusted logits."""
    got, expected = list(got), list(expected)
    if got == expected:
        return
    first = next(i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b)
    assert gaps[first] < TIE_GAP, f"token {first}: got {got}, reference {expected}"


def greedy(**kw) -> SamplingParams:  # noqa: ANN003
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def first_greedy_tokens(model, prompts: list[list[int]]) -> list[int]:  # noqa: ANN001
    with torch.inference_mode():
        return [int(model(torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]


def check_against_reference(make_engine, model, prompts, params_per_prompt) -> list[list[int]]:  # noqa: ANN001
    outputs = make_engine().generate(prompts, params_per_prompt)
    for prompt, params, out in zip(prompts, params_per_prompt, outputs, strict=True):
        assert out.error is None
        expected, gaps = penalised_greedy(model, prompt, params)
        assert_tokens(out.token_ids, expected, gaps)
    return [list(o.token_ids) for o in outputs]


@pytest.mark.parametrize(
    ("field", "encourage", "discourage"),
    [
        ("presence_penalty", -2.0, 2.0),
        ("frequency_penalty", -0.5, 0.3),
        ("repetition_penalty", 0.5, 2.0),
    ],
)
def test_penalties_equal_first_principles(
    make_engine, reference_models, prompt_ids, field, encourage, discourage
) -> None:  # noqa: ANN001
    model = reference_models["llama"]
    plain = [list(o.token_ids) for o in make_engine().generate(prompt_ids, greedy())]
    assert all(len(set(p)) == len(p) for p in plain)  # no repeats without a penalty
    # Encouraging repetition: the first token comes back.
    encouraged = check_against_reference(
        make_engine, model, prompt_ids, [greedy(**{field: encourage})] * len(prompt_ids)
    )
    assert any(Counter(o).most_common(1)[0][1] > 1 for o in encouraged)
    # A +1 bias makes each prompt's first greedy token win every step; the penalty stops it.
    firsts = first_greedy_tokens(model, prompt_ids)
    biased = [greedy(logit_bias={t: 1.0}) for t in firsts]
    repeated = check_against_reference(make_engine, model, prompt_ids, biased)
    assert all(o == [t] * MAX_TOKENS for o, t in zip(repeated, firsts, strict=True))
    penalised = [greedy(logit_bias={t: 1.0}, **{field: discourage}) for t in firsts]
    held_back = check_against_reference(make_engine, model, prompt_ids, penalised)
    for out, token in zip(held_back, firsts, strict=True):
        assert out[0] == token and 1 <= out.count(token) < MAX_TOKENS


def test_presence_is_paid_once_frequency_per_use(make_engine, reference_models, prompt_ids) -> None:
    """A +3 bias against a presence penalty of 1 still wins every step (it costs 1 however often
    the token came); against a frequency penalty of 1 it stops after a few uses."""
    model = reference_models["llama"]
    firsts = first_greedy_tokens(model, prompt_ids)
    for field, always in (("presence_penalty", True), ("frequency_penalty", False)):
        params = [greedy(logit_bias={t: 3.0}, **{field: 1.0}) for t in firsts]
        outputs = check_against_reference(make_engine, model, prompt_ids, params)
        for out, token in zip(outputs, firsts, strict=True):
            assert (out == [token] * MAX_TOKENS) is always


def test_repetition_penalty_multiplies_negative_logits_as_hf() -> None:
    """Against Hugging Face's RepetitionPenaltyLogitsProcessor on negative logits, where the
    divide-or-multiply choice decides the argmax."""
    from transformers import RepetitionPenaltyLogitsProcessor

    sampler = Sampler(eos_token_ids=[])
    generator = torch.Generator().manual_seed(0)
    differs = 0
    for _ in range(50):
        logits = torch.randn(1, 40, generator=generator) - 4.0
        best = logits[0].topk(3).indices.tolist()
        # below 1 the runners-up in the prompt gain; above 1 the best one in it loses
        for penalty, seen in ((0.6, best[1:]), (1.8, best[:1])):
            expected = RepetitionPenaltyLogitsProcessor(penalty)(
                torch.tensor([seen]), logits.clone()
            ).argmax()
            req = Request("r", seen, SamplingParams(repetition_penalty=penalty))
            assert sampler(logits.clone(), [req]).token_ids == [int(expected)]
            differs += int(expected) != int(logits.argmax())
    assert differs > 20  # the penalty really moved the choice


@pytest.mark.parametrize("penalty", [1e-300, 1e-40, 2.0**-127, 2.0**127, 1e39, 1e300])
def test_a_repetition_penalty_float32_cannot_hold_is_refused(penalty: float) -> None:
    """1e-300 is 0 in float32 and gave infinite logits (issue 31): a penalty or reciprocal
    outside float32's normal range is a ValueError naming the field (Serve's 400, the job's
    error row)."""
    with pytest.raises(ValueError, match="repetition_penalty .*float32"):
        SamplingParams(repetition_penalty=penalty)


@pytest.mark.parametrize("penalty", [2.0**-126, 1e-30, 2.0**126])
def test_an_extreme_accepted_penalty_saturates_instead_of_overflowing(penalty: float) -> None:
    """At the ends of the accepted range a seen logit's quotient or product leaves float32: it
    saturates at the largest float, so the row holds no infinity and sampling draws from it."""
    sampler = Sampler(eos_token_ids=[])
    logits = torch.tensor([[3.0, 50.0, -40.0, 1.0]])
    seen = [1, 2]  # 50 / penalty and -40 * penalty overflow at one end or the other
    req = Request("r", seen, SamplingParams(repetition_penalty=penalty))
    adjusted = apply_penalties(logits.clone(), [req])
    assert bool(torch.isfinite(adjusted).all()), adjusted
    expected = 1 if penalty < 1 else 0  # below 1 the seen best gains; above, it loses to 3.0
    assert sampler(logits.clone(), [req]).token_ids == [expected]
    sampled = Request("s", seen, SamplingParams(repetition_penalty=penalty, temperature=1.0))
    assert 0 <= sampler(logits.clone(), [sampled]).token_ids[0] < 4


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_hf_generate(
    make_engine, reference_models, prompt_ids, penalty
) -> None:  # noqa: ANN001
    model = reference_models["llama"]
    outputs = make_engine().generate(prompt_ids, greedy(repetition_penalty=penalty))
    with torch.inference_mode():
        for ids, out in zip(prompt_ids, outputs, strict=True):
            expected = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                repetition_penalty=penalty,
                pad_token_id=model.config.pad_token_id,
            )[0, len(ids) :].tolist()
            _, gaps = penalised_greedy(model, ids, greedy(repetition_penalty=penalty))
            assert_tokens(out.token_ids, expected, gaps)


def test_logit_bias_forces_and_bans(make_engine, reference_models, prompt_ids) -> None:
    model = reference_models["llama"]
    forced = make_engine().generate(prompt_ids, greedy(logit_bias={"42": 100}))
    assert all(list(o.token_ids) == [42] * MAX_TOKENS for o in forced)
    firsts = first_greedy_tokens(model, prompt_ids)
    banned = [greedy(logit_bias={t: -100}) for t in firsts]
    outputs = check_against_reference(make_engine, model, prompt_ids, banned)
    with torch.inference_mode():
        for ids, out, first in zip(prompt_ids, outputs, firsts, strict=True):
            runner_up = int(model(torch.tensor([ids])).logits[0, -1].topk(2).indices[1])
            assert out[0] == runner_up != first and first not in out


def test_logprobs_stay_those_of_the_raw_model(make_engine, reference_models, prompt_ids) -> None:
    model = reference_models["llama"]
    params = greedy(logit_bias={42: 100.0}, presence_penalty=1.0, logprobs=1)
    out = make_engine().generate(prompt_ids[:1], params)[0]
    assert out.logprobs is not None and list(out.token_ids) == [42] * MAX_TOKENS
    with torch.inference_mode():
        for k, entry in enumerate(out.logprobs):
            ids = prompt_ids[0] + [42] * k
            raw = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            assert abs(entry.logprob - float(raw[42])) < 1e-4
            assert entry.top[0][0] == int(raw.argmax())  # the raw favourite, not the forced one


def test_min_p_drops_unlikely_tokens_after_temperature() -> None:
    probs = torch.tensor([0.50, 0.25, 0.16, 0.06, 0.02, 0.01])
    logits = probs.log()
    sampler = Sampler(eos_token_ids=[])
    # min_p 0.3: keep p >= 0.3 * 0.5 (tokens 0-2). At temperature 2 the tempered probabilities
    # go as sqrt(p): a token stays when p >= 0.09 * 0.5, so token 3 (0.06) comes in.
    cases = {1.0: {0, 1, 2}, 2.0: {0, 1, 2, 3}}
    for temperature, allowed in cases.items():
        seen = Counter()
        for seed in range(600):
            req = Request(
                "r", [1, 2, 3], SamplingParams(temperature=temperature, min_p=0.3, seed=seed)
            )
            seen.update(sampler(logits[None].clone(), [req]).token_ids)
        assert set(seen) == allowed, (temperature, seen)


def test_min_p_one_is_greedy(make_engine, prompt_ids) -> None:
    plain = make_engine().generate(prompt_ids, greedy())
    sampled = make_engine().generate(prompt_ids, greedy(temperature=1.0, seed=3, min_p=1.0))
    assert [o.token_ids for o in sampled] == [o.token_ids for o in plain]


def test_adjusted_requests_leave_their_neighbours_alone(make_engine, prompt_ids) -> None:
    plain = [greedy(), greedy(temperature=0.9, seed=11), greedy(temperature=1.0, top_k=50, seed=12)]
    special = [
        greedy(presence_penalty=-2.0),
        greedy(logit_bias={42: 100}, frequency_penalty=0.5),
        greedy(temperature=1.0, seed=5, min_p=0.5, repetition_penalty=0.7),
    ]
    prompts = prompt_ids * 2
    alone = make_engine(seed=1).generate(prompt_ids, plain)
    mixed = make_engine(seed=1).generate(prompts, plain + special)
    special_alone = make_engine(seed=1).generate(prompt_ids, special)
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
    assert [o.token_ids for o in mixed[3:5]] == [o.token_ids for o in special_alone[:2]]
    assert mixed[5].token_ids == special_alone[2].token_ids  # seeded: the batch does not matter


def test_a_logit_bias_outside_the_vocabulary_fails_that_request_only(
    make_engine, prompt_ids
) -> None:
    engine = make_engine()
    vocab = engine.vocab_size
    outputs = engine.generate(prompt_ids[:2], [greedy(logit_bias={vocab: 5}), greedy()])
    assert outputs[0].finish_reason == "error" and str(vocab) in (outputs[0].error or "")
    assert outputs[0].error.startswith("logit_bias")
    assert list(outputs[1].token_ids) == list(
        make_engine().generate(prompt_ids[1:2], greedy())[0].token_ids
    )
    # A row the sampler cannot adjust (an id past this logits row) fails alone there too.
    sampler = Sampler(eos_token_ids=[])
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    reqs = [Request("a", [1], SamplingParams(logit_bias={7: 1.0})), Request("b", [1], greedy())]
    result = sampler.sample_each(logits, reqs)
    assert set(result.errors) == {0} and result.token_ids[1] == 0


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("presence_penalty", 2.5, "[-2.0, 2.0]"),
        ("frequency_penalty", -3, "[-2.0, 2.0]"),
        ("repetition_penalty", 0.0, "> 0"),
        ("repetition_penalty", float("nan"), "> 0"),
        ("min_p", 1.5, "[0.0, 1.0]"),
        ("logit_bias", {5: 101}, "[-100, 100]"),
        ("logit_bias", {"x": 1}, "token ids"),
        ("logit_bias", {-1: 1}, "token ids"),
        ("logit_bias", [(5, 1.0, 2)], "map token ids"),
    ],
)
def test_out_of_range_values_name_the_field(field, value, allowed) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    message = str(err.value)
    assert message.startswith(field) and allowed in message


def test_logit_bias_is_stored_as_sorted_pairs() -> None:
    params = SamplingParams(logit_bias={"9": 1, 3: -2.5})
    assert params.logit_bias == ((3, -2.5), (9, 1.0))
    assert hash(params) == hash(SamplingParams(logit_bias=[(9, 1.0), (3, -2.5)]))
    neutral = SamplingParams(presence_penalty=0, frequency_penalty=0, repetition_penalty=1)
    assert not neutral.penalised and neutral == SamplingParams()
