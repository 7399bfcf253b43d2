"""Hostile requests against the live app (issue 18): every one a 4xx naming the field, no
neighbour failed, /health answering throughout."""

from __future__ import annotations

import json
import threading

import pytest
import requests

from tests.serve.conftest import MODEL, Live

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

OK = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
CHAT_OK = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
SAMPLED = {**OK, "temperature": 1.0}


def post_raw(live: Live, path: str, raw: str) -> requests.Response:
    """POST a body as written (NaN and Infinity are not JSON, but clients send them)."""
    headers = {"content-type": "application/json"}
    return requests.post(live.url(path), data=raw.encode(), headers=headers, timeout=60)


def error_of(response: requests.Response, status: int) -> dict:
    """The OpenAI error object of a `status` answer."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


BAD_VALUES = [
    # (field, JSON text of the value, extra fields)
    ("seed", str(2**64), {}),  # one past torch.Generator's range: took the server down
    ("seed", str(-(2**63) - 1), {}),
    ("seed", "1e400", {}),
    ("top_k", str(2**63), {"top_p": 0.5}),  # overflowed in the sampler, failing the step
    ("top_k", str(2**31), {"top_p": 0.5}),
    ("temperature", "NaN", {}),
    ("temperature", "Infinity", {}),
    ("temperature", "-Infinity", {}),
    ("temperature", "1e30", {}),
    ("temperature", "1e400", {}),
    ("top_p", "NaN", {}),
    ("top_p", "Infinity", {}),
    ("top_p", "1e30", {}),
    ("top_p", "-1e-300", {}),
    ("max_tokens", str(2**64), {}),
    ("seed", '"7"', {}),  # wrong types
    ("temperature", '"0.5"', {}),
    ("top_k", "1.5", {}),
    ("top_p", "true", {}),
    ("stream", '"yes"', {}),
    ("stop", "5", {}),
    ("max_tokens", "[1]", {}),
    ("n", str(2**70), {}),
]


@pytest.mark.parametrize(("field", "value", "extra"), BAD_VALUES)
def test_bad_sampling_values_are_400_naming_the_field(
    live: Live, field: str, value: str, extra: dict
) -> None:
    body = {**SAMPLED, **extra}
    body.pop(field, None)
    raw = json.dumps(body)[:-1] + f', "{field}": {value}}}'
    error = error_of(post_raw(live, "/v1/completions", raw), 400)
    assert error["param"] == field and field in error["message"], error
    chat = {**CHAT_OK, "temperature": 1.0, **extra}
    chat.pop(field, None)
    raw = json.dumps(chat)[:-1] + f', "{field}": {value}}}'
    error = error_of(post_raw(live, "/v1/chat/completions", raw), 400)
    assert error["param"] == field, error


def test_values_at_the_edge_are_served(live: Live) -> None:
    for extra in ({"seed": 2**64 - 1}, {"seed": -(2**63)}, {"top_k": 2**31 - 1, "top_p": 0.5}):
        answer = requests.post(live.url("/v1/completions"), json={**SAMPLED, **extra}, timeout=60)
        assert answer.status_code == 200, (extra, answer.text)


def test_float32_underflow_is_the_value_it_is(live: Live) -> None:
    """1e-300 is 0 in float32: a temperature that small is greedy and a top_p that small keeps
    only the best token, so both give the greedy text (before, both gave empty text)."""
    url = live.url("/v1/completions")
    body = {**OK, "max_tokens": 8, "ignore_eos": True}
    greedy = requests.post(url, json=body, timeout=60).json()["choices"][0]["text"]
    assert greedy
    for extra in ({"temperature": 1e-300}, {"temperature": 1.0, "top_p": 1e-300}):
        answer = requests.post(url, json={**body, **extra}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == greedy, extra


def test_a_bad_request_fails_no_neighbour(live: Live) -> None:
    """A stream is running while bad seeds and top_k arrive: it ends with [DONE], every bad
    one is a 400, and /health answers all along."""
    events: list[str] = []
    body = {**OK, "max_tokens": 60, "ignore_eos": True, "stream": True}

    def stream() -> None:
        with requests.post(live.url("/v1/completions"), json=body, stream=True, timeout=120) as r:
            assert r.status_code == 200
            events.extend(line for line in r.iter_lines(decode_unicode=True) if line)

    thread = threading.Thread(target=stream)
    thread.start()
    for raw in (
        json.dumps({**SAMPLED, "seed": 2**64}),
        json.dumps({**SAMPLED, "top_k": 2**63, "top_p": 0.9}),
        json.dumps(SAMPLED)[:-1] + ', "temperature": NaN}',
    ):
        assert post_raw(live, "/v1/completions", raw).status_code == 400
        assert requests.get(live.url("/health"), timeout=10).status_code == 200
    thread.join(timeout=120)
    assert events[-1] == "data: [DONE]"
    assert not any('"error"' in e for e in events), events[-3:]
    finals = [json.loads(e[6:]) for e in events[:-1]]
    assert finals[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["text"]) > 0 for c in finals) > 0


def test_routing_errors_carry_their_code(live: Live) -> None:
    error = error_of(requests.get(live.url("/v1/completions"), timeout=10), 405)
    assert error["code"] == "method_not_allowed"
    error = error_of(requests.get(live.url("/v1/nothing"), timeout=10), 404)
    assert error["code"] == "not_found"
    error = error_of(requests.delete(live.url("/health"), timeout=10), 405)
    assert error["code"] == "method_not_allowed"
