"""A fuzz over the request schema against the live app (issue 18): a few hundred generated
bodies for /v1/completions and /v1/chat/completions (extreme numbers, NaN, wrong types, huge
and empty strings, unknown fields, raw bytes); every answer is a 200 or a 4xx with OpenAI's
error body, and the server is healthy afterwards."""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serve.conftest import MODEL, Live

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLES = 150  # per endpoint
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same bodies every run: a failure is reproducible
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

extreme_ints = st.sampled_from(
    [
        0,
        1,
        -1,
        2,
        400,
        2**31 - 1,
        2**31,
        2**32,
        2**63 - 1,
        2**63,
        2**64 - 1,
        2**64,
        -(2**63) - 1,
        10**30,
    ]
) | st.integers(-(2**70), 2**70)
extreme_floats = st.sampled_from(
    [0.0, -0.0, 1e-300, 5e-324, 1e-5, 0.5, 1.0, 2.0, 2.0000001, 1e30, 1e308]
) | st.floats(allow_nan=True, allow_infinity=True)
strings = st.sampled_from(["", " ", "<|im_end|>", "\x00", "é" * 50, "x" * 20_000]) | st.text(
    max_size=40
)
junk = (
    st.none()
    | st.booleans()
    | strings
    | st.lists(st.integers(), max_size=3)
    | st.dictionaries(st.text(max_size=5), st.integers(), max_size=2)
)
number = extreme_ints | extreme_floats | junk
prompt = (
    strings
    | st.lists(extreme_ints, max_size=8)
    | st.lists(strings, max_size=3)
    | st.lists(st.lists(st.integers(-5, 60_000), max_size=5), max_size=2)
    | junk
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", ""]) | junk},
    optional={
        "content": strings
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": strings}), max_size=2)
        | junk,
        "name": strings | junk,
        "extra": junk,
    },
)
sampling = {
    "temperature": number,
    "top_p": number,
    "top_k": number,
    "seed": number,
    "max_tokens": number,
    "n": number,
    "stop": strings | st.lists(strings, max_size=6) | junk,
    "stream": st.booleans() | junk,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | junk}) | junk,
    "ignore_eos": st.booleans() | junk,
    "user": strings | junk,
    "logprobs": number,
    "unknown_field": junk,
}
model = st.just(MODEL) | st.just(MODEL) | strings | junk
completion_bodies = st.fixed_dictionaries(
    {"model": model, "prompt": prompt},
    optional={**sampling, "echo": st.booleans() | junk, "best_of": number},
)
chat_bodies = st.fixed_dictionaries(
    {"model": model, "messages": st.lists(message, max_size=3) | junk},
    optional={**sampling, "max_completion_tokens": number, "top_logprobs": number},
)
raw_bodies = st.binary(max_size=64) | st.sampled_from(
    [b"", b"null", b"[]", b"{", b'{"model": NaN}', b"\xff\xfe", b'{"prompt": "' + b"a" * 30_000]
)


def check(live: Live, path: str, data: bytes) -> None:
    """One request: a 200 (with a body of the right shape) or a 4xx error body, never a 5xx."""
    headers = {"content-type": "application/json"}
    answer = requests.post(live.url(path), data=data, headers=headers, timeout=120)
    assert answer.status_code < 500, (answer.status_code, answer.text[:300], data[:300])
    if answer.status_code == 200:
        text = answer.text
        if text.startswith("data: "):
            assert text.rstrip().endswith("data: [DONE]"), text[-300:]
            assert '"error"' not in text, text[-300:]
        else:
            assert answer.json()["choices"], text[:300]
    else:
        error = answer.json()["error"]
        assert error["message"] and error["type"], error


def encoded(body: dict[str, Any]) -> bytes:
    """The body as a client would send it (NaN and Infinity included, as Python's json does)."""
    if isinstance(body.get("max_tokens"), int) and 0 < body["max_tokens"] <= 400:
        body["max_tokens"] = min(body["max_tokens"], 24)  # keep valid requests short
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")


@FUZZ
@given(body=completion_bodies)
def test_fuzz_completions(live: Live, body: dict[str, Any]) -> None:
    check(live, "/v1/completions", encoded(body))


@FUZZ
@given(body=chat_bodies)
def test_fuzz_chat_completions(live: Live, body: dict[str, Any]) -> None:
    check(live, "/v1/chat/completions", encoded(body))


@settings(FUZZ, max_examples=40)
@given(data=raw_bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzz_raw_bodies(live: Live, data: bytes, path: str) -> None:
    check(live, path, data)


def test_healthy_after_the_fuzz(live: Live) -> None:
    assert requests.get(live.url("/health"), timeout=30).json()["status"] == "ok"
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    answer = requests.post(live.url("/v1/completions"), json=body, timeout=60)
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"]
