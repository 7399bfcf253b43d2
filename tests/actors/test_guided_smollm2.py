"""Guided decoding on the embedded SmolLM2-135M-Instruct: a schema that forbids what the
model says unconstrained, and greedy equal to HF `generate` with xgrammar's processor."""

from __future__ import annotations

import json

import jsonschema
import pytest

from actors import EngineConfig, LLMEngine, SamplingParams
from actors.guided import GuidedDecodingParams
from actors.loader import load_model
from tests.actors.test_guided import hf_guided

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]
QUESTIONS = ["What is the capital of France?", "Name a colour of the sky.", "Who wrote Hamlet?"]
# Unconstrained the model answers in prose; this schema allows only a number and a boolean.
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer", "minimum": 0, "maximum": 999},
        "sure": {"type": "boolean"},
    },
    "required": ["answer", "sure"],
}


def test_smollm2_schema_forbids_the_free_answer_and_matches_hf(tokenizer) -> None:
    engine = LLMEngine(
        EngineConfig(dtype="float32", num_kv_blocks=128),
        model=load_model("smollm2"),
        tokenizer=tokenizer,
    )
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in QUESTIONS
    ]
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    free = engine.generate(prompts, SamplingParams(max_tokens=16))
    for out in free:
        with pytest.raises(ValueError):
            json.loads(out.text)
    guided = GuidedDecodingParams(json=SCHEMA)
    outs = engine.generate(prompts, SamplingParams(max_tokens=32, guided_decoding=guided))
    reference = load_model("smollm2")
    for ids, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert list(out.token_ids) == hf_guided(reference, engine, ids, guided)
