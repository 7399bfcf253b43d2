"""Sampling parameters over HTTP change what is generated, as OpenAI and vLLM define them:
checked against Hugging Face greedy references of the served tiny model (context-sensitive,
see tests/test_tiny_models.py).

Not covered here: logprobs (tests/serve/test_logprobs_http.py) and
`min_tokens` (not a field of the HTTP API); both are checked through the engine and the job.
Penalties and logit_bias are compared with first-principles references (the HF model's
logits adjusted by hand, tests/sampling_cases.py); the engine tests cover each in depth
(tests/actors/test_penalties.py).
"""

from __future__ import annotations

import json

import pytest
import requests

from actors.config import SamplingParams
from tests.sampling_cases import (
    EOS_AT,
    EOS_ID,
    EOS_PROMPT,
    STOP_PROMPT,
    greedy_loop,
    penalised_greedy,
    stop_string,
    tokens_until,
)
from tests.serve.conftest import MODEL, Live
from tests.serve.hf_reference import HFReference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROMPT = "Once upon a time"
N = 12


@pytest.fixture(scope="module")
def hf(live: Live) -> HFReference:
    return HFReference(live.model_dir)


def complete(live: Live, **fields) -> dict:  # noqa: ANN003
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": N, **fields}
    answer = requests.post(live.url("/v1/completions"), json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def text_of(data: dict) -> str:
    return data["choices"][0]["text"]


def test_temperature_and_seed(live: Live, hf: HFReference) -> None:
    greedy = hf.greedy(PROMPT, N).text
    assert text_of(complete(live, temperature=0)) == greedy
    sampled = text_of(complete(live, temperature=1.0, seed=7))
    assert sampled != greedy  # sampling really samples
    assert text_of(complete(live, temperature=1.0, seed=7)) == sampled  # same seed, same text
    assert text_of(complete(live, temperature=1.0, seed=8)) != sampled  # another seed, another


def test_top_k_one_and_tiny_top_p_are_greedy(live: Live, hf: HFReference) -> None:
    greedy = hf.greedy(PROMPT, N).text
    assert text_of(complete(live, temperature=1.0, seed=3)) != greedy
    assert text_of(complete(live, temperature=1.0, seed=3, top_k=1)) == greedy
    assert text_of(complete(live, temperature=1.0, seed=3, top_p=1e-6)) == greedy


def test_stop_string_triggers_and_is_cut(live: Live, hf: HFReference) -> None:
    """OpenAI: generation ends at the first stop string, which is not returned."""
    full = hf.greedy(STOP_PROMPT, 16)
    stop = stop_string(full.text)
    expected = full.text[: full.text.index(stop)]
    data = complete(live, prompt=STOP_PROMPT, max_tokens=16, temperature=0, stop=[stop, "\x00"])
    assert text_of(data) == expected
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["usage"]["completion_tokens"] == tokens_until(hf.tokenizer, full.token_ids, stop)

    # streamed: the pieces never show the stop string (nor a piece of it) and end the same
    body = {
        "model": MODEL,
        "prompt": STOP_PROMPT,
        "max_tokens": 16,
        "temperature": 0,
        "stop": stop,
        "stream": True,
    }
    with requests.post(live.url("/v1/completions"), json=body, stream=True, timeout=120) as r:
        events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == expected
    assert chunks[-1]["finish_reason"] == "stop"


def test_eos_stops_unless_ignore_eos(live: Live, hf: HFReference) -> None:
    ids = hf.prompt_ids(EOS_PROMPT)
    natural = hf.greedy(EOS_PROMPT, 10)
    assert natural.token_ids[-1] == EOS_ID and len(natural.token_ids) == EOS_AT + 1  # precondition
    data = complete(live, prompt=EOS_PROMPT, max_tokens=10, temperature=0)
    assert text_of(data) == natural.text
    assert data["choices"][0]["finish_reason"] == "stop"

    past = greedy_loop(hf.model, ids, 10, eos_stops=False)
    assert past[: EOS_AT + 1] == natural.token_ids and len(past) == 10
    data = complete(live, prompt=EOS_PROMPT, max_tokens=10, temperature=0, ignore_eos=True)
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 10
    assert text_of(data) == hf.tokenizer.decode(past, skip_special_tokens=True)


def test_penalties_and_logit_bias_change_the_text(live: Live, hf: HFReference) -> None:
    ids = hf.prompt_ids(PROMPT)
    plain = greedy_loop(hf.model, ids, N, eos_stops=False)

    def expected(**fields) -> str:  # noqa: ANN003
        tokens, _ = penalised_greedy(hf.model, ids, SamplingParams(max_tokens=N, **fields))
        assert tokens != plain  # the field has a visible effect on this prompt
        return hf.tokenizer.decode(tokens, skip_special_tokens=True)

    # presence_penalty -2 makes the first token come back (the tiny model never repeats itself)
    data = complete(live, temperature=0, ignore_eos=True, presence_penalty=-2.0)
    assert text_of(data) == expected(presence_penalty=-2.0)
    # logit_bias: +100 forces a token; -100 on the greedy first token bans it
    data = complete(live, temperature=0, ignore_eos=True, logit_bias={"42": 100})
    assert text_of(data) == hf.tokenizer.decode([42] * N) == expected(logit_bias={42: 100})
    banned = {str(plain[0]): -100}
    data = complete(live, temperature=0, ignore_eos=True, logit_bias=banned)
    assert text_of(data) == expected(logit_bias={plain[0]: -100})

    # chat: a repetition penalty below 1 (the chat's prompt tokens come back)
    chat = [{"role": "user", "content": PROMPT}]
    chat_ids = hf.prompt_ids(chat)
    body = {
        "model": MODEL,
        "messages": chat,
        "max_tokens": N,
        "temperature": 0,
        "ignore_eos": True,
        "repetition_penalty": 0.5,
    }
    answer = requests.post(live.url("/v1/chat/completions"), json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    tokens, _ = penalised_greedy(
        hf.model, chat_ids, SamplingParams(max_tokens=N, repetition_penalty=0.5)
    )
    assert tokens != greedy_loop(hf.model, chat_ids, N, eos_stops=False)
    content = answer.json()["choices"][0]["message"]["content"]
    assert content == hf.tokenizer.decode(tokens, skip_special_tokens=True)


def test_out_of_range_penalty_is_a_400_naming_it(live: Live) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "frequency_penalty": 2.5}
    answer = requests.post(live.url("/v1/completions"), json=body, timeout=120)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "frequency_penalty"
    assert "frequency_penalty" in error["message"] and "2.5" in error["message"]


def test_n_choices_over_http_streamed_and_not(live: Live, hf: HFReference) -> None:
    expected = hf.greedy(PROMPT, N)
    data = complete(live, temperature=0, n=3)
    assert [(c["index"], c["text"]) for c in data["choices"]] == [
        (i, expected.text) for i in range(3)
    ]
    assert data["usage"]["completion_tokens"] == 3 * len(expected.token_ids)
    assert data["usage"]["prompt_tokens"] == expected.num_prompt_tokens  # once, not n times
    # Streamed with a seed: each chunk names its choice; choice i is what n=1 with seed + i
    # gives.
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": N, "n": 2, "temperature": 1.0}
    answer = requests.post(
        live.url("/v1/completions"), json={**body, "seed": 7, "stream": True}, timeout=120
    )
    assert answer.status_code == 200, answer.text
    texts = {0: "", 1: ""}
    for line in answer.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[len("data: ") :])["choices"]:
                texts[choice["index"]] += choice["text"]
    assert texts[0] == text_of(complete(live, temperature=1.0, seed=7))
    assert texts[1] == text_of(complete(live, temperature=1.0, seed=8))
