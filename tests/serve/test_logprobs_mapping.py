"""logprobs / top_logprobs map onto SamplingParams.logprobs and the engine's TokenLogprobs onto
OpenAI's two shapes (no Ray: OpenAIService.prepare_* and the response builders alone, with the
served tokenizer). Bodies are checked by parsing them into the `openai` SDK's own types."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from actors.loader import load_tokenizer
from actors.outputs import RequestOutput, TokenLogprob
from pipeline.serve.config import ServeConfig
from pipeline.serve.errors import APIError
from pipeline.serve.logprobs import LogprobShaper
from pipeline.serve.service import OpenAIService

CHAT = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def service(tokenizer) -> OpenAIService:  # noqa: ANN001
    config = ServeConfig(served_model_name="m", api_keys_env=None)
    return OpenAIService(config, None, tokenizer, 512, len(tokenizer))  # type: ignore[arg-type]


def completion(service: OpenAIService, **fields):  # noqa: ANN003, ANN201
    return service.prepare_completion(json.dumps({"model": "m", "prompt": "Hi", **fields}).encode())


def chat(service: OpenAIService, **fields):  # noqa: ANN003, ANN201
    body = {"model": "m", "messages": CHAT, "max_tokens": 4, **fields}
    return service.prepare_chat(json.dumps(body).encode())


def refused(call, param: str) -> str:  # noqa: ANN001
    with pytest.raises(APIError) as info:
        call()
    assert info.value.status == 400 and info.value.detail.param == param
    assert param in info.value.detail.message
    return str(info.value.detail.code)


def test_completion_logprobs_map_to_the_engine(service) -> None:  # noqa: ANN001
    plain = completion(service)
    assert plain.params.logprobs is None and plain.header.logprobs is None
    for k in (0, 2, 20):  # 0..20 as vLLM (OpenAI stops at 5)
        prepared = completion(service, logprobs=k)
        assert prepared.params.logprobs == k and prepared.header.logprobs is not None
    assert completion(service, logprobs=None).params.logprobs is None
    refused(lambda: completion(service, logprobs=21), "logprobs")
    refused(lambda: completion(service, logprobs=-1), "logprobs")
    assert refused(lambda: completion(service, echo=True), "echo") == "unsupported_value"


def test_chat_logprobs_and_top_logprobs_map_to_the_engine(service) -> None:  # noqa: ANN001
    assert chat(service).params.logprobs is None
    assert chat(service, logprobs=False).params.logprobs is None
    assert chat(service, logprobs=False, top_logprobs=None).header.logprobs is None
    assert chat(service, logprobs=True).params.logprobs == 0
    assert chat(service, logprobs=True, top_logprobs=3).params.logprobs == 3
    assert chat(service, logprobs=True, top_logprobs=20).params.logprobs == 20
    # OpenAI and vLLM: top_logprobs needs logprobs: true, whatever its value
    refused(lambda: chat(service, top_logprobs=2), "top_logprobs")
    refused(lambda: chat(service, logprobs=False, top_logprobs=0), "top_logprobs")
    refused(lambda: chat(service, logprobs=True, top_logprobs=21), "top_logprobs")
    refused(lambda: chat(service, logprobs=1), "logprobs")  # strict: a bool, not a number


def test_completion_shape(tokenizer) -> None:  # noqa: ANN001
    hello, world, bang = (tokenizer.encode(t, add_special_tokens=False)[0] for t in "Ab!")
    entries = (
        TokenLogprob(hello, -0.5, top=((hello, -0.5), (world, -1.5))),
        TokenLogprob(bang, -7.0, top=((hello, -0.25), (world, -1.0))),  # sampled, not in top
        TokenLogprob(world, float("-inf"), top=()),
    )
    body = LogprobShaper(tokenizer).completion(entries, offset=3)
    token = [tokenizer.decode([t]) for t in (hello, world, bang)]
    assert body.tokens == [token[0], token[2], token[1]]
    assert body.token_logprobs == [-0.5, -7.0, -9999.0]  # -inf as OpenAI writes it
    assert body.top_logprobs == [
        {token[0]: -0.5, token[1]: -1.5},
        {token[0]: -0.25, token[1]: -1.0, token[2]: -7.0},  # up to k + 1: the sampled one too
        {token[1]: -9999.0},  # k = 0: the sampled token alone
    ]
    assert list(body.top_logprobs[1].values()) == sorted(body.top_logprobs[1].values())[::-1]
    assert body.text_offset == [3, 4, 5]  # each token decodes to one character here


def test_full_bodies_parse_into_the_sdk_types(service, tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode(" caf\u00e9 \u2603", add_special_tokens=False)
    entries = tuple(
        TokenLogprob(t, -1.0 - i, top=((t, -1.0 - i), (0, -20.0))) for i, t in enumerate(ids)
    )
    output = RequestOutput(
        "e", 3, tuple(ids), tokenizer.decode(ids), True, "length", logprobs=entries
    )
    body = completion(service, logprobs=1).header.full(output).model_dump(mode="json")
    parsed = Completion.model_validate(body).choices[0].logprobs
    assert parsed is not None and parsed.tokens == [tokenizer.decode([t]) for t in ids]
    assert parsed.token_logprobs == [e.logprob for e in entries]

    body = chat(service, logprobs=True, top_logprobs=2).header.full(output).model_dump(mode="json")
    content = ChatCompletion.model_validate(body).choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == len(ids)
    for entry, item in zip(entries, content, strict=True):
        token = tokenizer.decode([entry.token_id])
        assert item.token == token and item.bytes == list(token.encode("utf-8"))
        assert item.logprob == entry.logprob
        assert [t.token for t in item.top_logprobs] == [token, tokenizer.decode([0])]
        assert [t.logprob for t in item.top_logprobs] == [entry.logprob, -20.0]

    plain = chat(service).header.full(output).model_dump(mode="json")
    assert plain["choices"][0]["logprobs"] is None
