"""OpenAI request bodies map onto the engine's SamplingParams as OpenAI and vLLM define the
fields (no Ray: OpenAIService.prepare_* only validates and maps)."""

from __future__ import annotations

import json

import pytest

from actors.loader import load_tokenizer
from pipeline.serve.config import ServeConfig
from pipeline.serve.errors import APIError
from pipeline.serve.service import OpenAIService

CONTEXT = 512
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def service(tokenizer) -> OpenAIService:  # noqa: ANN001
    config = ServeConfig(served_model_name="m", api_keys_env=None)
    return OpenAIService(config, None, tokenizer, CONTEXT, len(tokenizer))  # type: ignore[arg-type]


def completion(service: OpenAIService, **fields):  # noqa: ANN003, ANN201
    return service.prepare_completion(json.dumps({"model": "m", "prompt": "Hi", **fields}).encode())


def test_openai_defaults(service, tokenizer) -> None:  # noqa: ANN001
    prepared = completion(service)
    params = prepared.params
    assert prepared.prompt_token_ids == tokenizer.encode("Hi", add_special_tokens=False)
    assert params.temperature == 1.0 and params.top_p == 1.0  # OpenAI's defaults: sampling
    assert params.top_k in (0, -1) and params.seed is None and params.stop == ()
    assert params.max_tokens == 16 and not params.ignore_eos and params.min_tokens == 0
    assert prepared.stream is False


def test_every_field_reaches_the_engine(service) -> None:  # noqa: ANN001
    params = completion(
        service,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        seed=11,
        stop=["\n", "END"],
        ignore_eos=True,
        max_tokens=7,
    ).params
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.7, 0.9, 5, 11)
    assert params.stop == ("\n", "END") and params.ignore_eos and params.max_tokens == 7
    assert completion(service, stop="x").params.stop == ("x",)
    assert completion(service, temperature=0).params.greedy
    assert not completion(service, temperature=0.5).params.greedy


def test_top_k_minus_one_means_all(service) -> None:  # noqa: ANN001
    """vLLM: top_k -1 (or 0) keeps every token; it is not an error."""
    params = completion(service, top_k=-1, temperature=1.0).params
    assert params.top_k <= 0


def test_token_ids_and_chat_prompts(service, tokenizer) -> None:  # noqa: ANN001
    assert completion(service, prompt=[5, 6, 7]).prompt_token_ids == [5, 6, 7]
    assert completion(service, prompt=[[5, 6]]).prompt_token_ids == [5, 6]
    with pytest.raises(APIError) as info:
        completion(service, prompt=[5, len(tokenizer)])
    assert info.value.status == 400 and info.value.detail.param == "prompt"

    body = {"model": "m", "messages": CHAT, "max_tokens": 9, "max_completion_tokens": 4}
    prepared = service.prepare_chat(json.dumps(body).encode())
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert prepared.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert prepared.params.max_tokens == 4  # max_completion_tokens wins (OpenAI)


NEUTRAL = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "min_p": 0,
    "logit_bias": {},
    "user": "u-1",
}


def test_neutral_penalties_and_bias_are_accepted(service) -> None:  # noqa: ANN001
    """What the OpenAI SDK and LangChain send by default changes nothing (chat and completions)."""
    assert completion(service, **NEUTRAL).params == completion(service).params
    body = {"model": "m", "messages": CHAT, **NEUTRAL}
    plain = service.prepare_chat(json.dumps({"model": "m", "messages": CHAT}).encode()).params
    assert service.prepare_chat(json.dumps(body).encode()).params == plain


def test_penalties_min_p_and_logit_bias_reach_the_engine(service) -> None:  # noqa: ANN001
    fields = {
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "repetition_penalty": 1.3,
        "min_p": 0.05,
        "logit_bias": {"42": 100, "7": -100, "3": 2.5},
    }
    for params in (
        completion(service, **fields).params,
        service.prepare_chat(
            json.dumps({"model": "m", "messages": CHAT, **fields}).encode()
        ).params,
    ):
        assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1.0)
        assert (params.repetition_penalty, params.min_p) == (1.3, 0.05)
        assert params.logit_bias == ((3, 2.5), (7, -100.0), (42, 100.0))


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("presence_penalty", 2.5, "[-2.0, 2.0], got 2.5"),
        ("frequency_penalty", -3, "[-2.0, 2.0], got -3"),
        ("repetition_penalty", 0, "> 0, got 0"),
        ("min_p", 1.1, "[0.0, 1.0], got 1.1"),
        ("logit_bias", {"5": 101}, "[-100, 100], got 101"),
        ("logit_bias", {"five": 1}, "token ids"),
        ("logit_bias", {"49152": 1}, "[0, 49152), got 49152"),
    ],
)
def test_out_of_range_values_are_a_400_naming_the_field(service, field, value, words) -> None:  # noqa: ANN001
    with pytest.raises(APIError) as info:
        completion(service, **{field: value})
    assert info.value.status == 400 and info.value.detail.param == field
    assert field in info.value.detail.message and words in info.value.detail.message
