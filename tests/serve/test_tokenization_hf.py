"""Serve tokenizes as Hugging Face on a tokenizer that adds BOS (no Ray: the service's and
/tokenize's own functions): a completion's text prompt as `tokenizer(prompt)`, a chat as
`apply_chat_template(..., tokenize=True)` (one BOS), and /tokenize counts what they count;
`add_special_tokens` (vLLM's field) turns the tokenizer's special tokens off or on."""

from __future__ import annotations

import json

import pytest

from pipeline.serve.config import ServeConfig
from pipeline.serve.service import OpenAIService
from pipeline.serve.tokens import tokenize
from tests.tiny_tokenizers import BOS, tiny_tokenizer

PROMPT = "the cat sat on the mat"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
CONTEXT = 512


@pytest.fixture(scope="module")
def tok():  # noqa: ANN201
    return tiny_tokenizer("bos")


@pytest.fixture(scope="module")
def service(tok) -> OpenAIService:  # noqa: ANN001
    config = ServeConfig(served_model_name="m", api_keys_env=None)
    return OpenAIService(config, None, tok, CONTEXT, len(tok))  # type: ignore[arg-type]


def body(**fields) -> bytes:  # noqa: ANN003
    return json.dumps({"model": "m", **fields}).encode()


def counted(tok, **fields) -> list[int]:  # noqa: ANN001, ANN003
    return tokenize(body(**fields), tok, "m", CONTEXT).tokens


def test_completion_prompt_is_tokenized_as_the_tokenizer_does(service, tok) -> None:  # noqa: ANN001
    expected = tok(PROMPT)["input_ids"]
    assert expected[0] == BOS
    assert service.prepare_completion(body(prompt=PROMPT)).prompt_token_ids == expected
    assert counted(tok, prompt=PROMPT) == expected
    bare = tok(PROMPT, add_special_tokens=False)["input_ids"]
    off = service.prepare_completion(body(prompt=PROMPT, add_special_tokens=False))
    assert off.prompt_token_ids == bare == counted(tok, prompt=PROMPT, add_special_tokens=False)
    # token ids stay as given
    assert service.prepare_completion(body(prompt=[5, 6])).prompt_token_ids == [5, 6]


def test_chat_holds_the_templates_bos_once(service, tok) -> None:  # noqa: ANN001
    expected = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    ids = service.prepare_chat(body(messages=CHAT)).prompt_token_ids
    assert ids == expected["input_ids"] and ids.count(BOS) == 1
    assert counted(tok, messages=CHAT) == ids
    # vLLM's add_special_tokens on a chat: the tokenizer's on top of the template's
    assert counted(tok, messages=CHAT, add_special_tokens=True) == [BOS, *ids]
