"""Text prompts are tokenized as `tokenizer(prompt)` and chats as `apply_chat_template(...,
tokenize=True)`, on tokenizers that add BOS, BOS and EOS, or nothing (tests/tiny_tokenizers.py);
the engine's greedy outputs on text prompts equal `model.generate(**tokenizer(prompt,
return_tensors="pt"))` on each prompt alone."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from actors import EngineConfig, LLMEngine, SamplingParams
from actors.tokenization import (
    ChatTemplateError,
    encode_chat,
    encode_text,
    encode_texts,
    special_tokens_around,
)
from tests.actors.reference import assert_greedy_match
from tests.tiny_models import tiny_model
from tests.tiny_tokenizers import BOS, EOS, STYLES, model_args, tiny_tokenizer

TEXTS = (
    "the cat sat on the mat",
    "in the beginning there was a tokenizer",
    "a",
    "<|im_end|> is spelled out in this text prompt",
)
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name the three primary colours, then stop."},
]
MAX_TOKENS = 10
ADDED = {"bos": ([BOS], []), "bos_eos": ([BOS], [EOS]), "none": ([], [])}


@pytest.fixture(scope="module", params=STYLES)
def style(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def tok(style):
    return tiny_tokenizer(style)


def hf_ids(tok, text: str) -> list[int]:
    return tok(text, return_tensors="pt")["input_ids"][0].tolist()


def hf_chat_ids(tok, messages, add_generation_prompt: bool = True) -> list[int]:
    return tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )["input_ids"]


def test_text_prompts_get_the_tokenizers_special_tokens(tok, style) -> None:
    prefix, suffix = ADDED[style]
    assert special_tokens_around(tok) == (prefix, suffix)
    for text in TEXTS:
        bare = tok(text, add_special_tokens=False)["input_ids"]
        assert encode_text(tok, text) == hf_ids(tok, text) == prefix + bare + suffix
        assert encode_text(tok, text, add_special_tokens=False) == bare
    assert encode_texts(tok, TEXTS) == [hf_ids(tok, t) for t in TEXTS]
    assert encode_texts(tok, TEXTS, add_special_tokens=False) == [
        tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS
    ]


def test_chat_prompts_hold_the_templates_bos_once(tok, style) -> None:
    ids = encode_chat(tok, CHAT)
    assert ids == hf_chat_ids(tok, CHAT)
    assert ids.count(BOS) == (0 if style == "none" else 1)
    assert ids[0] == (BOS if style != "none" else ids[0]) and ids[1] != BOS
    assert encode_chat(tok, CHAT, add_generation_prompt=False) == hf_chat_ids(tok, CHAT, False)
    prefix, suffix = ADDED[style]  # vLLM's chat add_special_tokens: on top of the template
    assert encode_chat(tok, CHAT, add_special_tokens=True) == prefix + ids + suffix
    with pytest.raises(ChatTemplateError):
        encode_chat(PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer), CHAT)


@torch.inference_mode()
def hf_generate(model, tok, text: str) -> list[int]:
    """`model.generate(**tokenizer(prompt, return_tensors="pt"))`, greedy, on `text` alone."""
    inputs = tok(text, return_tensors="pt")
    out = model.generate(
        **inputs, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id
    )
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_equals_hf_generate_on_text_and_chat(tok, arch) -> None:
    reference = tiny_model(arch, **model_args(tok))
    engine = LLMEngine(
        EngineConfig(dtype="float32", num_kv_blocks=64),
        model=tiny_model(arch, **model_args(tok)),
        tokenizer=tok,
    )
    params = SamplingParams(max_tokens=MAX_TOKENS)
    outputs = engine.generate(list(TEXTS), params)
    for text, out in zip(TEXTS, outputs, strict=True):
        assert out.error is None and list(out.prompt_token_ids) == hf_ids(tok, text)
        expected = hf_generate(reference, tok, text)
        assert_greedy_match(reference, out.prompt_token_ids, out.token_ids, expected)

    chat_ids = encode_chat(tok, CHAT)
    (out,) = engine.generate([chat_ids], params)
    inputs = tok.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        expected = reference.generate(
            **inputs, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id
        )[0, inputs["input_ids"].shape[1] :].tolist()
    assert_greedy_match(reference, chat_ids, out.token_ids, expected)
