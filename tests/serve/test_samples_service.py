"""`n` choices through the OpenAI service and the staging loop on a real tiny engine (no Ray):
choices indexed 0..n-1 (greedy: each equal to Hugging Face `generate`), streamed chunks that
each name their choice, usage with the prompt counted once, best_of's n best."""

from __future__ import annotations

import asyncio
import json

import pytest

from actors import EngineConfig, LLMEngine
from actors.loader import load_tokenizer
from packing.admission import AdmissionConfig
from pipeline.serve.config import ServeConfig
from pipeline.serve.service import OpenAIService
from pipeline.serve.staging import EngineLoop
from tests.actors.reference import hf_greedy, torch_threads
from tests.tiny_models import tiny_model

MAX_TOKENS = 5


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return load_tokenizer("smollm2")


def serve(tokenizer, body: dict, chat: bool = False):  # noqa: ANN001, ANN201
    """The body's answer (a pydantic body, or the SSE lines when streamed)."""

    async def go():  # noqa: ANN202
        engine = LLMEngine(
            EngineConfig(dtype="float32", num_kv_blocks=128),
            model=tiny_model(),
            tokenizer=tokenizer,
        )
        loop = EngineLoop(engine, AdmissionConfig(policy="immediate"), max_waiting=8)
        loop.start()
        config = ServeConfig(served_model_name="m", api_keys_env=None)
        service = OpenAIService(config, loop, tokenizer, 512, len(tokenizer))
        raw = json.dumps({"model": "m", **body}).encode()
        prepared = service.prepare_chat(raw) if chat else service.prepare_completion(raw)
        stream = service.submit(prepared)
        try:
            if prepared.stream:
                return [line async for line in service.events(prepared, stream)]
            return await service.respond(prepared, stream)
        finally:
            await loop.stop()

    with torch_threads(1):
        return asyncio.run(asyncio.wait_for(go(), timeout=60))


def test_n_choices_greedy_each_equal_to_hf_and_usage_counts_the_prompt_once(tokenizer):
    prompt = "The quick brown fox jumps over the lazy dog because"
    body = {"prompt": prompt, "n": 3, "temperature": 0, "max_tokens": MAX_TOKENS}
    answer = serve(tokenizer, {**body, "ignore_eos": True}).model_dump()
    ids = tokenizer(prompt)["input_ids"]
    with torch_threads(1):
        expected = tokenizer.decode(hf_greedy(tiny_model(), ids, MAX_TOKENS))
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert [c["text"] for c in answer["choices"]] == [expected] * 3
    usage = answer["usage"]
    assert usage["prompt_tokens"] == len(ids)
    assert usage["completion_tokens"] == 3 * MAX_TOKENS
    assert usage["total_tokens"] == len(ids) + 3 * MAX_TOKENS
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1


def test_streamed_chat_chunks_name_their_choice(tokenizer):
    body = {
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "n": 2,
        "temperature": 1.0,
        "seed": 11,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    lines = serve(tokenizer, body, chat=True)
    assert lines[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    text: dict[int, str] = {0: "", 1: ""}
    finished = set()
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        text[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"] is not None:
            finished.add(choice["index"])
    assert finished == {0, 1}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    # The same request not streamed gives the same two choices (seed + index per choice).
    whole = serve(tokenizer, {**body, "stream": False, "stream_options": None}, chat=True)
    assert [c.message.content for c in whole.choices] == [text[0], text[1]]
    assert text[0] != text[1]


def test_best_of_returns_n_choices(tokenizer):
    body = {"prompt": "Once upon a time", "n": 2, "best_of": 4, "seed": 3, "max_tokens": 4}
    answer = serve(tokenizer, body).model_dump()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in answer["choices"])
