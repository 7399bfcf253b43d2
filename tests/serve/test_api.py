"""The live OpenAI-compatible API: shapes, streaming, greedy equality with Hugging Face
`generate` on each prompt alone."""

from __future__ import annotations

import json
import time

import pytest
import requests

from tests.serve.conftest import MODEL, Live
from tests.serve.hf_reference import HFReference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]


@pytest.fixture(scope="module")
def hf(live: Live) -> HFReference:
    return HFReference(live.model_dir)


def sse_events(response: requests.Response) -> list[str]:
    """The data fields of a server-sent event stream, in order."""
    events = []
    for line in response.iter_lines(decode_unicode=True):
        if line:
            assert line.startswith("data: "), line
            events.append(line[len("data: ") :])
    return events


def test_health_and_models(live: Live) -> None:
    health = requests.get(live.url("/health"), timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    models = requests.get(live.url("/v1/models"), timeout=10).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 512


def test_completions_greedy_equal_hf_generate(live: Live, hf: HFReference) -> None:
    expected = [hf.greedy(p, 12) for p in PROMPTS]
    for prompt, ref in zip(PROMPTS, expected, strict=True):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        answer = requests.post(live.url("/v1/completions"), json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        data = answer.json()
        assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
        choice = data["choices"][0]
        assert choice["text"] == ref.text
        assert choice["finish_reason"] == "length"
        assert data["usage"]["prompt_tokens"] == ref.num_prompt_tokens
        assert data["usage"]["completion_tokens"] == 12
        assert data["usage"]["total_tokens"] == ref.num_prompt_tokens + 12
    # token ids in, the same text out
    ids = hf.prompt_ids(PROMPTS[0])
    body = {"model": MODEL, "prompt": ids, "max_tokens": 12, "temperature": 0}
    data = requests.post(live.url("/v1/completions"), json=body, timeout=60).json()
    assert data["choices"][0]["text"] == expected[0].text


def test_streamed_completion_concatenates_to_hf_output(live: Live, hf: HFReference) -> None:
    ref = hf.greedy(PROMPTS[1], 10)
    body = {
        "model": MODEL,
        "prompt": PROMPTS[1],
        "max_tokens": 10,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with requests.post(live.url("/v1/completions"), json=body, stream=True, timeout=60) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        events = sse_events(answer)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert len(text_chunks) >= 2  # tokens arrive as they are sampled, not in one piece
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == ref.text
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 10


def test_chat_streamed_and_not_equal_hf_generate(live: Live, hf: HFReference) -> None:
    ref = hf.greedy(CHAT, 8)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0}
    data = requests.post(live.url("/v1/chat/completions"), json=body, timeout=60).json()
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"] == {"role": "assistant", "content": ref.text}
    assert data["usage"]["prompt_tokens"] == ref.num_prompt_tokens

    body["stream"] = True
    with requests.post(live.url("/v1/chat/completions"), json=body, stream=True, timeout=60) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks)
    assert text == ref.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_openai_client_unchanged(live: Live, hf: HFReference) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=live.url("/v1"), api_key="not-checked", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == [MODEL]

    ref = hf.greedy(PROMPTS[2], 6)
    completion = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=6, temperature=0, seed=1, stop=["\n\n\n"]
    )
    assert completion.choices[0].text == ref.text
    assert completion.usage is not None and completion.usage.completion_tokens == 6

    chat_ref = hf.greedy(CHAT, 6)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == chat_ref.text
    assert chat.choices[0].finish_reason == "length"

    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == chat_ref.text


def test_sampling_with_seed_is_reproducible(live: Live) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 1.0, "seed": 7}
    first = requests.post(live.url("/v1/completions"), json=body, timeout=60).json()
    second = requests.post(live.url("/v1/completions"), json=body, timeout=60).json()
    assert first["choices"][0]["text"] == second["choices"][0]["text"]


def test_admission_policy_switches_in_place(live: Live) -> None:
    from dataclasses import asdict

    from ray import serve

    from packing.admission import AdmissionConfig

    created = requests.get(live.url("/v1/models"), timeout=10).json()["data"][0]["created"]
    handle = serve.get_app_handle("main")
    try:
        handle.reconfigure.remote({"admission": asdict(AdmissionConfig("immediate"))}).result()
        assert requests.get(live.url("/health"), timeout=10).json()["policy"] == "immediate"
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0}
        assert requests.post(live.url("/v1/completions"), json=body, timeout=60).ok
        with pytest.raises(Exception, match="n_min"):
            handle.reconfigure.remote({"admission": {"n_min": 0}}).result()
    finally:
        original = asdict(live.configs["main"].admission)
        handle.reconfigure.remote({"admission": original}).result()
    assert requests.get(live.url("/health"), timeout=10).json()["policy"] == "aimd"
    # the same replica (same start time): the model was not reloaded
    assert requests.get(live.url("/v1/models"), timeout=10).json()["data"][0]["created"] == created


def test_metrics_reach_prometheus(live: Live) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0}
    assert requests.post(live.url("/v1/completions"), json=body, timeout=60).ok
    wanted = {
        "ray_raypack_serve_ttft_seconds_count",
        "ray_raypack_serve_time_per_output_token_seconds_count",
        "ray_raypack_serve_queue_depth",
        "ray_raypack_serve_admission_threshold",
        "ray_raypack_serve_generated_tokens_total",
    }
    found: set[str] = set()
    deadline = time.monotonic() + 60  # Ray exports every few seconds
    while not wanted <= found and time.monotonic() < deadline:
        try:
            text = requests.get(live.metrics_url, timeout=10).text
            found = {line.split("{")[0].split(" ")[0] for line in text.splitlines()}
        except requests.ConnectionError:
            pass
        time.sleep(1)
    assert wanted <= found, sorted(wanted - found)
