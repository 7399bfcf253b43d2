"""Tiny random models whose attention has a sliding window (window 32) or a logit softcap, built
as tests/tiny_models.py builds its models (fixed seeds, the SmolLM2 vocabulary, embeddings of
spread 1 and layer matrices of spread `LAYER_STD`, so the context moves the logits), and
long prompts (4x the window) that share openings longer than the window.

`window_model(name, windowed=False)` is the same model (same weights) with every window and
softcap taken out: the tests check that its greedy outputs differ, so the window and the cap
really change what these prompts generate.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig

from packing.prefix import PrefixGroup
from tests.actors.groups import SYSTEM, TRANSLATE, common_prefix_len
from tests.actors.reference import sample_prompts
from tests.tiny_models import VOCAB, model_from_config

WINDOW = 32
NO_WINDOW = 4096  # a window longer than any prompt here: as none (Gemma needs one)
_COMMON = dict(
    vocab_size=VOCAB,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
# name -> (model_type, its config beyond the common part)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # every layer windowed
    "mistral": (
        "mistral",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW),
    ),
    # Qwen2's use_sliding_window: layers from max_window_layers on are windowed
    "qwen2": (
        "qwen2",
        dict(
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=16,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
        ),
    ),
    # Gemma 2 interleaves local (windowed) and global layers; its default softcap (50) and
    # query_pre_attn_scalar (256, not head_dim)
    "gemma2": (
        "gemma2",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
    # Gemma 2 whose attention logit softcap (2.0) and scale (query_pre_attn_scalar 24 for
    # head_dim 16) decide the tokens; no window
    "gemma2_softcap": (
        "gemma2",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=NO_WINDOW,
            attn_logit_softcapping=2.0,
            query_pre_attn_scalar=24,
        ),
    ),
    # Gemma 3's pattern: local layers (own rope base) around a global one
    "gemma3_text": (
        "gemma3_text",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
}
NUM_LAYERS = 3


def window_config(name: str, windowed: bool = True) -> Any:
    """The transformers config of `name`; `windowed=False`: no window, no attention softcap,
    the default scale (1/sqrt(head_dim)): plain causal attention."""
    model_type, spec = MODELS[name]
    spec = dict(spec)
    heads, head_dim = int(spec["num_attention_heads"]), int(spec["head_dim"])
    if not windowed:
        spec.pop("use_sliding_window", None)
        spec["sliding_window"] = None
        if model_type.startswith("gemma"):  # Gemma always builds its local layers' mask
            spec["sliding_window"] = NO_WINDOW
            spec["query_pre_attn_scalar"] = head_dim
        if model_type == "gemma2":
            spec["attn_logit_softcapping"] = None
    return AutoConfig.for_model(
        model_type,
        hidden_size=heads * head_dim,
        intermediate_size=2 * heads * head_dim,
        num_hidden_layers=NUM_LAYERS,
        **_COMMON,
        **spec,
    )


def window_model(name: str, windowed: bool = True, dtype: torch.dtype = torch.float32) -> Any:
    """A tiny random model (the same weights for both values of `windowed`), in eval mode on
    CPU; its attention implementation is eager for Gemma 2 (transformers' only one with a
    softcap), else SDPA."""
    torch.manual_seed(0)
    config = window_config(name, windowed)
    impl = "eager" if config.model_type == "gemma2" else "sdpa"
    return model_from_config(config, attn_implementation=impl).to(dtype)


def long_prompt_ids(tokenizer: Any) -> list[list[int]]:
    """Eight prompts of 4-6 windows (128-200 tokens) of real text: four open with the same
    90 tokens, two with the same 45, two share nothing."""
    texts = iter(sample_prompts(87))

    def tokens(opening: str, length: int) -> list[int]:
        ids = tokenizer.encode(opening, add_special_tokens=False)
        while len(ids) < length:
            ids += tokenizer.encode(" " + next(texts), add_special_tokens=False)
        return ids[:length]

    system, translate = tokens(SYSTEM, 90), tokens(TRANSLATE, 45)
    prompts = [system + tokens("", n) for n in (40, 55, 71, 110)]
    prompts += [translate + tokens("", n) for n in (83, 100)]
    prompts += [tokens("", 4 * WINDOW), tokens("", 200)]
    return prompts


def long_prompt_groups(prompt_ids: list[list[int]]) -> list[PrefixGroup]:
    """The two groups of `long_prompt_ids`: members 0-3 and 4-5, by their common openings."""
    return [
        PrefixGroup(prefix_len=common_prefix_len([prompt_ids[m] for m in members]), members=members)
        for members in ((0, 1, 2, 3), (4, 5))
    ]
