"""Hostile input II (issue 31), Serve's side: streamed text equals unstreamed text for any stop
strings; deep JSON nesting is a 400 on every endpoint; non-text chat parts are refused by name;
a repetition_penalty float32 cannot hold is a 400; a non-ASCII X-Request-ID is served.

The first tests call the parsers and the proxy's middleware directly (no Ray); the live ones
share the session's `live` app (tests/serve/conftest.py)."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest
import requests

from pipeline.serve.config import ServeConfig
from pipeline.serve.errors import APIError
from pipeline.serve.protocol import json_value
from pipeline.serve.proxy_headers import (
    PROXY_CALLBACK,
    PROXY_CALLBACK_VARIABLE,
    RequestIdFilter,
    use_in_proxy,
)
from pipeline.serve.router import routing_text
from pipeline.serve.service import OpenAIService
from pipeline.serve.tokens import detokenize, tokenize
from tests.serve.conftest import MODEL, Live
from tests.tiny_tokenizers import tiny_tokenizer

DEEP = 1001  # Python's json.loads raised RecursionError here: /tokenize answered 500
USER = {"role": "user", "content": "Hi"}
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def deep_bodies() -> dict[str, bytes]:
    """A body per endpoint whose value nests DEEP arrays where the endpoint reads one."""
    deep = nested(DEEP)
    return {
        "/tokenize": f'{{"model": "{MODEL}", "prompt": {deep}}}'.encode(),
        "/tokenize (messages)": f'{{"model": "{MODEL}", "messages": {deep}}}'.encode(),
        "/detokenize": f'{{"model": "{MODEL}", "tokens": {deep}}}'.encode(),
        "/v1/completions": f'{{"model": "{MODEL}", "prompt": {deep}}}'.encode(),
        "/v1/chat/completions": f'{{"model": "{MODEL}", "messages": {deep}}}'.encode(),
    }


@pytest.fixture(scope="module")
def service() -> OpenAIService:
    tokenizer = tiny_tokenizer("none")
    config = ServeConfig(served_model_name=MODEL, api_keys_env=None)
    return OpenAIService(config, None, tokenizer, 512, len(tokenizer))  # type: ignore[arg-type]


def api_error(call: Any) -> APIError:
    with pytest.raises(APIError) as info:
        call()
    return info.value


def test_deep_nesting_is_a_400_on_every_parser(service: OpenAIService) -> None:
    tokenizer = service.tokenizer
    parsers = {
        "/tokenize": lambda body: tokenize(body, tokenizer, MODEL, 512),
        "/tokenize (messages)": lambda body: tokenize(body, tokenizer, MODEL, 512),
        "/detokenize": lambda body: detokenize(body, tokenizer, MODEL, len(tokenizer)),
        "/v1/completions": service.prepare_completion,
        "/v1/chat/completions": service.prepare_chat,
    }
    for path, body in deep_bodies().items():
        error = api_error(lambda body=body, path=path: parsers[path](body))
        assert error.status == 400 and error.detail.code == "invalid_json", (path, error)
        assert "recursion limit" in error.detail.message, (path, error.detail)
    # the routing front reads the same bodies: no prefix, the replica answers the 400
    assert routing_text(deep_bodies()["/v1/completions"]) == ""
    assert json_value(f'{{"prompt": {nested(150)}}}'.encode()) is not None
    assert json_value(nested(DEEP).encode()) is None  # pydantic's limit is 200 levels


def test_non_text_chat_parts_are_refused_by_name(service: OpenAIService) -> None:
    for part, words in ((IMAGE, "images are not supported"), (AUDIO, "audio is not supported")):
        content = [{"type": "text", "text": "What is this?"}, part]
        raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]})
        for parse in (
            service.prepare_chat,
            lambda body: tokenize(body, service.tokenizer, MODEL, 512),
        ):
            error = api_error(lambda parse=parse, raw=raw: parse(raw.encode()))
            assert error.status == 400 and error.detail.code == "unsupported_value"
            assert error.detail.param == "messages.0.content"
            assert words in error.detail.message and part["type"] in error.detail.message
    text_parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": text_parts}]}
    assert service.prepare_chat(json.dumps(body).encode()).prompt_token_ids


def test_the_proxy_filter_drops_only_a_request_id_that_is_not_printable_ascii() -> None:
    seen: list[list[tuple[bytes, bytes]]] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        seen.append(scope["headers"])

    async def main() -> None:
        filtered = RequestIdFilter(app)
        for value in (b"abc-123", b"\xe9", "日本".encode(), b"a\x00b"):
            headers = [(b"host", b"h"), (b"x-request-id", value), (b"x-other", b"\xe9")]
            await filtered({"type": "http", "headers": headers}, None, None)

    asyncio.run(main())
    assert seen[0] == [(b"host", b"h"), (b"x-request-id", b"abc-123"), (b"x-other", b"\xe9")]
    assert all(h == [(b"host", b"h"), (b"x-other", b"\xe9")] for h in seen[1:])
    environ: dict[str, str] = {}
    assert use_in_proxy(environ) and environ[PROXY_CALLBACK_VARIABLE] == PROXY_CALLBACK
    environ[PROXY_CALLBACK_VARIABLE] = "mine:callback"  # the operator's own is kept
    assert not use_in_proxy(environ) and environ[PROXY_CALLBACK_VARIABLE] == "mine:callback"


# ---- the live app -------------------------------------------------------------------------

N = 24  # tokens per answer: the tiny random model runs on without an EOS (ignore_eos)


def completion_text(live: Live, path: str, body: dict) -> tuple[str, str]:
    """The unstreamed text and finish reason of a completion or chat."""
    answer = requests.post(live.url(path), json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    return text, choice["finish_reason"]


def streamed_text(live: Live, path: str, body: dict) -> tuple[str, str]:
    """The concatenated deltas and the last finish reason of the same request streamed."""
    pieces: list[str] = []
    reason = None
    with requests.post(
        live.url(path), json={**body, "stream": True}, stream=True, timeout=60
    ) as answer:
        assert answer.status_code == 200, answer.text
        for line in answer.iter_lines(decode_unicode=True):
            if not line or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            assert "error" not in chunk, chunk
            choice = chunk["choices"][0]
            piece = choice["text"] if "text" in choice else choice["delta"].get("content")
            pieces.append(piece or "")
            reason = choice["finish_reason"] or reason
    return "".join(pieces), reason


def stop_sets(text: str) -> list[list[str]]:
    """Stop strings for an answer whose uncut text is `text`: never there (short, one of 20
    characters longer than early text), pieces of it (several, overlapping, one inside
    another), whitespace, multi-byte."""
    middle = len(text) // 2
    return [
        ["</s>"],  # the case: ' 2 + 2 =' streamed as '  2 + 2 ='
        ["x" * 20],  # longer than the text for the first tokens
        ["\u00e9\u65e5\U0001f642"],  # multi-byte, absent
        [text[middle : middle + 3]],
        [text[middle : middle + 6], text[middle + 2 : middle + 4]],  # one inside another
        [text[-4:], "qqqq", text[middle + 1 : middle + 3], "日本"],  # four
        [" "],
        [text[3:5], text[4:7]],  # overlapping, early
        [text[:-1] + "\u00e9"],  # as long as the whole text, never complete
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("path", "base"),
    [
        ("/v1/completions", {"prompt": "Q: what is 2 + 2? A:"}),
        ("/v1/chat/completions", {"messages": [USER]}),
    ],
)
def test_streamed_text_equals_unstreamed_for_any_stop_strings(
    live: Live, path: str, base: dict
) -> None:
    body = {"model": MODEL, "max_tokens": N, "temperature": 0, "ignore_eos": True, **base}
    uncut, _ = completion_text(live, path, body)
    assert len(uncut) > 12, uncut
    for stops in stop_sets(uncut):
        for max_tokens in (N, 3):
            asked = {**body, "stop": stops, "max_tokens": max_tokens}
            expected = completion_text(live, path, asked)
            assert streamed_text(live, path, asked) == expected, (stops, max_tokens)
    # a stop string that is there cuts both the same way, before it
    stop = uncut[len(uncut) // 2 : len(uncut) // 2 + 3]
    text, reason = completion_text(live, path, {**body, "stop": [stop]})
    assert (text, reason) == (uncut[: uncut.index(stop)], "stop")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_deep_nesting_is_a_json_400_over_http(live: Live) -> None:
    headers = {"content-type": "application/json"}
    for path, body in deep_bodies().items():
        path = path.split(" ")[0]
        answer = requests.post(live.url(path), data=body, headers=headers, timeout=60)
        assert answer.status_code == 400, (path, answer.status_code, answer.text[:200])
        assert answer.json()["error"]["code"] == "invalid_json", path
    assert requests.get(live.url("/health"), timeout=10).status_code == 200


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_image_part_is_a_400_saying_images_are_not_supported(live: Live) -> None:
    content = [{"type": "text", "text": "What is in this picture?"}, IMAGE]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    answer = requests.post(live.url("/v1/chat/completions"), json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert "images are not supported" in error["message"] and error["code"] == "unsupported_value"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("value", ["1e-300", "1e300", "1e-40"])
def test_a_repetition_penalty_float32_cannot_hold_is_a_400(live: Live, value: str) -> None:
    headers = {"content-type": "application/json"}
    for path, base in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {})):
        body = {"model": MODEL, "max_tokens": 4, "messages": [USER], **base}
        if "prompt" in base:
            del body["messages"]
        raw = json.dumps(body)[:-1] + f', "repetition_penalty": {value}}}'
        answer = requests.post(live.url(path), data=raw, headers=headers, timeout=60)
        assert answer.status_code == 400, (path, answer.text)
        error = answer.json()["error"]
        assert error["param"] == "repetition_penalty" and "float32" in error["message"], error


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_request_id_that_is_not_ascii_is_replaced_not_a_500(live: Live) -> None:
    """`requests` sends a str header as Latin-1: b'\\xe9', which Serve's proxy could not decode
    (a text/plain 500 before any replica). Its own id is used and sent back instead."""
    assert os.environ.get(PROXY_CALLBACK_VARIABLE) == PROXY_CALLBACK  # conftest's Ray has it
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    for request_id in ("caf\u00e9-1", "日本".encode().decode("latin-1")):
        answer = requests.post(
            live.url("/v1/completions"), json=body, headers={"X-Request-ID": request_id}, timeout=60
        )
        assert answer.status_code == 200, (answer.status_code, answer.text[:200])
        assert answer.headers["x-request-id"].isascii()
        assert answer.headers["x-request-id"] != request_id
    kept = requests.post(
        live.url("/v1/completions"), json=body, headers={"X-Request-ID": "trace-42"}, timeout=60
    )
    assert kept.status_code == 200 and kept.headers["x-request-id"] == "trace-42"
