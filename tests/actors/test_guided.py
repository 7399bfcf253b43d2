"""Guided decoding in the engine: outputs match their grammar, greedy equals Hugging Face
`generate` with xgrammar's own logits processor on each prompt alone, bad grammars fail
clearly, and the LM head's padding rows (vocabulary past the tokenizer's) are never sampled."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from xgrammar.contrib.hf import LogitsProcessor

from actors import EngineConfig, LLMEngine, SamplingParams
from actors.guided import GuidedDecodingParams, StructuredOutputsParams
from tests.actors.reference import TIE_GAP
from tests.tiny_models import tiny_model

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["cat", "dog", "bird"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["label", "score", "ok"],
}
PROMPTS = [
    "Classify the animal in: the thing barked at the mailman.",
    "Return JSON.",
    "A small bird sang on the wire at dawn, and the cat watched it from below.",
]
MAX_TOKENS = 48


@torch.inference_mode()
def hf_guided(model, engine: LLMEngine, prompt_ids: list[int], guided) -> list[int]:
    """Greedy tokens of `model.generate` with xgrammar's HF logits processor over the grammar
    the engine compiles (the same tokenizer info), on this prompt alone."""
    processor = LogitsProcessor(engine.guided.compile(guided))
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        logits_processor=[processor],
        pad_token_id=model.config.pad_token_id or 0,
    )
    return out[0, len(prompt_ids) :].tolist()


def assert_guided_match(model, prompt_ids: list[int], got: list[int], expected: list[int]):
    """Tokens must equal the reference's; a difference is allowed only at a logit tie: at the
    first differing token both tokens passed the same grammar state (the prefixes are equal),
    so they were the top two allowed ones, and the reference's logits for them must be within
    TIE_GAP (the tie shown, not assumed); after it the sequences may part."""
    if got == expected:
        return
    first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    assert first is not None, f"lengths differ with a common prefix: {got} vs {expected}"
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + expected[:first]])).logits[0, -1]
    gap = abs(float(logits[expected[first]] - logits[got[first]]))
    assert gap < TIE_GAP, (
        f"token {first} differs ({got[first]} vs {expected[first]}), gap {gap:.3g}"
    )


def _engine(tokenizer, **vocab: int) -> tuple[LLMEngine, torch.nn.Module]:
    engine = LLMEngine(
        EngineConfig(dtype="float32", num_kv_blocks=256),
        model=tiny_model("llama", **vocab),
        tokenizer=tokenizer,
    )
    return engine, tiny_model("llama", **vocab)


@pytest.mark.parametrize(
    "guided",
    [
        GuidedDecodingParams(json=SCHEMA),
        GuidedDecodingParams(json_object=True),
        GuidedDecodingParams(regex=r"[A-Z][a-z]{2,6} [0-9]{1,3}"),
        GuidedDecodingParams(choice=("positive", "negative", "neutral")),
        GuidedDecodingParams(grammar='root ::= "yes" | "no" | "maybe " [0-9]'),
    ],
    ids=lambda g: g.kind,
)
def test_greedy_guided_matches_hf_generate_with_xgrammar(tokenizer, guided) -> None:
    engine, reference = _engine(tokenizer)
    params = SamplingParams(max_tokens=MAX_TOKENS, guided_decoding=guided)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    outputs = engine.generate(prompt_ids, params)
    for ids, out in zip(prompt_ids, outputs, strict=True):
        assert out.error is None
        assert_guided_match(
            reference, ids, list(out.token_ids), hf_guided(reference, engine, ids, guided)
        )
        # Any JSON object is unbounded: a random model may still be inside a string.
        if guided.kind != "json_object":
            assert out.finish_reason == "stop", out
            _assert_matches(guided, out.text)


def _assert_matches(guided: GuidedDecodingParams, text: str) -> None:
    if guided.kind == "json":
        jsonschema.validate(json.loads(text), guided.schema)
    elif guided.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif guided.kind == "regex":
        assert re.fullmatch(guided.regex, text), text
    elif guided.kind == "choice":
        assert text in guided.choice
    else:
        assert re.fullmatch(r"yes|no|maybe [0-9]", text), text


def test_the_constraint_acts_and_random_sampling_is_guided_too(tokenizer) -> None:
    """Unconstrained, the tiny model's text is not a label; guided, every sampled row is
    (greedy and seeded random, mixed in one batch with an unguided row)."""
    engine, _ = _engine(tokenizer)
    prompt = tokenizer.encode(PROMPTS[0])
    free = engine.generate([prompt], SamplingParams(max_tokens=8))[0].text
    choice = GuidedDecodingParams(choice=("positive", "negative"))
    assert free not in choice.choice
    params = [SamplingParams(max_tokens=8)] + [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=s, guided_decoding=choice)
        for s in range(6)
    ]
    outs = engine.generate([prompt] * len(params), params)
    assert outs[0].text == free
    assert all(o.text in choice.choice and o.finish_reason == "stop" for o in outs[1:])
    schema = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=1.0, seed=3, guided_decoding={"json": SCHEMA}
    )
    for out in engine.generate([prompt] * 4, schema):
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_lm_head_padding_rows_are_masked(tokenizer) -> None:
    """A model whose LM head has 64 rows past the tokenizer's vocabulary, the padding rows
    made the best logits: unconstrained greedy picks them, guided never does."""
    vocab = len(tokenizer) + 64
    model = tiny_model("llama", vocab_size=vocab)
    with torch.no_grad():
        model.lm_head.weight[len(tokenizer) :] *= 50.0
    engine = LLMEngine(
        EngineConfig(dtype="float32", num_kv_blocks=128), model=model, tokenizer=tokenizer
    )
    prompt = tokenizer.encode(PROMPTS[1])
    free = engine.generate([prompt], SamplingParams(max_tokens=4))[0]
    assert any(t >= len(tokenizer) for t in free.token_ids)
    guided = SamplingParams(max_tokens=MAX_TOKENS, guided_decoding={"json": SCHEMA})
    out = engine.generate([prompt], guided)[0]
    assert all(t < len(tokenizer) for t in out.token_ids)
    jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"json": {"type": "nonsense"}}, "invalid guided json"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": {"$ref": "#/missing"}}, "invalid guided json"),
        ({"regex": "[a-z"}, "invalid guided regex"),
        ({"grammar": 'root ::= "a" |'}, "invalid guided grammar"),
        ({"choice": []}, "at least one"),
        ({"choice": "abc"}, "non-empty strings"),
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ],
)
def test_invalid_guided_params_are_value_errors(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(guided_decoding=kwargs)


def test_vllm_shapes_are_accepted() -> None:
    by_dict = SamplingParams(guided_decoding={"json": json.dumps(SCHEMA)})
    by_new_name = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    assert by_dict == by_new_name and by_new_name.structured_outputs is None
    assert by_dict.guided_decoding.schema == SCHEMA
    with pytest.raises(ValueError, match="unknown guided_decoding"):
        SamplingParams(guided_decoding={"json_schema": SCHEMA})
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(guided_decoding={"regex": "a"}, structured_outputs={"regex": "b"})


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 2], [0, 2, 3]])
def test_apply_bitmask_equals_xgrammars_kernel(rows) -> None:
    """The numpy path (contiguous rows in place, others gathered) against xgrammar's own."""
    import xgrammar as xgr

    from actors.guided import apply_bitmask

    vocab = 1000
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (len(rows), -(-vocab // 32)), dtype=torch.int32, generator=generator
    )
    logits = torch.randn(4, vocab, generator=generator)
    expected = logits.clone()
    full = torch.full((4, bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(expected, full, vocab_size=vocab, indices=rows)
    apply_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)
