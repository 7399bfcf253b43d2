"""logprobs over HTTP with the `openai` SDK itself: bodies parse into its types, the sampled
tokens' logprobs equal log_softmax of Hugging Face's logits for the served tiny model (within
TOL), top_logprobs come best first, and streamed logprobs add up to the non-streamed ones."""

from __future__ import annotations

import pytest
from openai import BadRequestError, OpenAI
from openai.types.chat import ChatCompletionTokenLogprob
from openai.types.completion_choice import Logprobs

from tests.sampling_cases import EOS_AT, EOS_PROMPT
from tests.serve.conftest import MODEL, Live
from tests.serve.hf_reference import HFReference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "Tell me a story"}]
N = 8
TOL = 1e-4  # absolute, on float32 logprobs (packed engine batch vs a solo HF forward)


@pytest.fixture(scope="module")
def hf(live: Live) -> HFReference:
    return HFReference(live.model_dir)


@pytest.fixture(scope="module")
def client(live: Live) -> OpenAI:
    return OpenAI(base_url=live.url("/v1"), api_key="not-checked", max_retries=0, timeout=120)


def reference(hf: HFReference, prompt_ids: list[int], out: list[int], k: int) -> list[dict]:
    """Per generated token: HF's logprob of it and its k best (id, logprob)."""
    rows = []
    for i, token in enumerate(out):
        logprobs = hf.logprobs(prompt_ids + out[:i])
        values, ids = logprobs.topk(k)
        rows.append(
            {
                "logprob": float(logprobs[token]),
                "top": list(zip(ids.tolist(), values.tolist(), strict=True)),
            }
        )
    return rows


def test_completion_logprobs_equal_hf(client: OpenAI, hf: HFReference) -> None:
    expected = hf.greedy(PROMPT, N)
    answer = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=2
    )
    lp = answer.choices[0].logprobs
    assert isinstance(lp, Logprobs) and answer.choices[0].text == expected.text
    assert lp.tokens == [hf.tokenizer.decode([t]) for t in expected.token_ids]
    assert answer.usage is not None and len(lp.tokens) == answer.usage.completion_tokens
    refs = reference(hf, hf.prompt_ids(PROMPT), expected.token_ids, 2)
    assert lp.token_logprobs is not None and lp.top_logprobs is not None
    for token, got, top, ref in zip(
        lp.tokens, lp.token_logprobs, lp.top_logprobs, refs, strict=True
    ):
        assert got == pytest.approx(ref["logprob"], abs=TOL)
        # greedy: the sampled token is the best one, so the dict holds exactly the 2 best
        assert len(top) == 2 and list(top)[0] == token and top[token] == got
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert list(top.values()) == pytest.approx([v for _, v in ref["top"]], abs=TOL)
        assert list(top) == [hf.tokenizer.decode([t]) for t, _ in ref["top"]]
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.text_offset == offsets

    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=2, stream=True
    )
    tokens, values, tops, text_offset = [], [], [], []
    pieces = 0
    for chunk in stream:
        piece = chunk.choices[0].logprobs
        if piece is not None:
            pieces += 1
            tokens += piece.tokens or []
            values += piece.token_logprobs or []
            tops += piece.top_logprobs or []
            text_offset += piece.text_offset or []
    assert pieces > 1  # each chunk carries its new tokens' logprobs
    assert tokens == lp.tokens and text_offset == lp.text_offset
    assert values == pytest.approx(lp.token_logprobs, abs=TOL)
    assert [list(t) for t in tops] == [list(t) for t in lp.top_logprobs]


def test_chat_logprobs_equal_hf(client: OpenAI, hf: HFReference) -> None:
    expected = hf.greedy(CHAT, N)  # type: ignore[arg-type]
    answer = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=N,
        temperature=0,
        logprobs=True,
        top_logprobs=2,  # type: ignore[arg-type]
    )
    assert answer.choices[0].logprobs is not None
    content = answer.choices[0].logprobs.content
    assert content is not None and all(isinstance(c, ChatCompletionTokenLogprob) for c in content)
    refs = reference(hf, hf.prompt_ids(CHAT), expected.token_ids, 2)  # type: ignore[arg-type]
    assert len(content) == len(expected.token_ids)
    for item, token_id, ref in zip(content, expected.token_ids, refs, strict=True):
        assert item.token == hf.tokenizer.decode([token_id])
        assert item.bytes == list(item.token.encode("utf-8"))
        assert item.logprob == pytest.approx(ref["logprob"], abs=TOL)
        assert [t.token for t in item.top_logprobs] == [
            hf.tokenizer.decode([t]) for t, _ in ref["top"]
        ]
        assert item.top_logprobs[0].token == item.token  # greedy: the best one
        assert item.top_logprobs[0].logprob == item.logprob
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx([v for _, v in ref["top"]], abs=TOL)

    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=N,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,  # type: ignore[arg-type]
    )
    streamed: list[ChatCompletionTokenLogprob] = []
    pieces = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            pieces += 1
            streamed += chunk.choices[0].logprobs.content or []
    assert pieces > 1
    assert [s.token for s in streamed] == [c.token for c in content]
    assert [s.logprob for s in streamed] == pytest.approx([c.logprob for c in content], abs=TOL)
    assert [[t.token for t in s.top_logprobs] for s in streamed] == [
        [t.token for t in c.top_logprobs] for c in content
    ]

    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None


def test_eos_token_has_its_entry(client: OpenAI, hf: HFReference) -> None:
    """As vLLM: one entry per generated token, the end-of-sequence token included."""
    answer = client.completions.create(
        model=MODEL, prompt=EOS_PROMPT, max_tokens=10, temperature=0, logprobs=0
    )
    lp = answer.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert answer.choices[0].finish_reason == "stop" and len(lp.tokens) == EOS_AT + 1
    assert lp.tokens[-1] == hf.tokenizer.eos_token
    assert all(len(top) == 1 for top in lp.top_logprobs)  # logprobs=0: the sampled token only


def test_invalid_logprobs_are_400_naming_the_field(client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, top_logprobs=2)  # type: ignore[arg-type]
    assert raised.value.param == "top_logprobs" and "logprobs" in raised.value.message
    with pytest.raises(BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logprobs=21)
    assert raised.value.param == "logprobs"
    with pytest.raises(BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, echo=True)
    assert raised.value.param == "echo" and raised.value.code == "unsupported_value"
