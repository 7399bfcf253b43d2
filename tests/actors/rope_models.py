"""Tiny models with a length-dependent rope (phi3 longrope, llama dynamic NTK), random
prompts for them, and HF `generate` on one prompt alone (tests/actors/test_rope_scaling.py,
tests/parallel/test_rope_parallel.py)."""

from __future__ import annotations

import copy

import torch
from transformers import AutoConfig

from tests.tiny_models import model_from_config

VOCAB = 512
HEAD_DIM = 16
ORIGINAL = 64  # longrope's original_max_position_embeddings; dynamic's max_position_embeddings
MAX_NEW = 12
# Below, around and above the threshold; 50 and 60 cross it while generating.
LENGTHS = [20, 50, 60, 63, 64, 65, 100, 150]


def rope_model(kind: str, rope: str | None = None):
    """A tiny phi3 (longrope), phi4 (phi3 longrope on 3/4 of each head, as Phi-4-mini) or
    llama (dynamic NTK) whose context moves its logits. `rope="default"`: the same weights
    with plain rope."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=4 * HEAD_DIM,
        intermediate_size=8 * HEAD_DIM,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    if kind in ("phi3", "phi4"):
        partial = 0.75 if kind == "phi4" else 1.0
        num_factors = int(HEAD_DIM * partial) // 2
        params = dict(
            rope_type="longrope",
            rope_theta=10000.0,
            short_factor=[1.0] * num_factors,
            long_factor=[4.0 + 3.0 * i for i in range(num_factors)],
            original_max_position_embeddings=ORIGINAL,
            factor=4.0,
            partial_rotary_factor=partial,
        )
        plain = dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=partial)
        config = AutoConfig.for_model(
            "phi3",
            max_position_embeddings=4 * ORIGINAL,
            original_max_position_embeddings=ORIGINAL,
            partial_rotary_factor=partial,
            rope_parameters=params if rope is None else plain,
            **common,
        )
    else:
        params = dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0)
        config = AutoConfig.for_model(
            "llama",
            max_position_embeddings=ORIGINAL,
            rope_parameters=params if rope is None else dict(rope_type=rope, rope_theta=1e4),
            head_dim=HEAD_DIM,
            **common,
        )
    model = model_from_config(config)
    model.generation_config.eos_token_id = None
    return model


def prompts(lengths: list[int], shared: int = 0, seed: int = 3) -> list[list[int]]:
    """Random token prompts of these lengths; the first `shared` tokens common to all."""
    generator = torch.Generator().manual_seed(seed)
    head = torch.randint(3, VOCAB, (shared,), generator=generator).tolist()
    return [
        head + torch.randint(3, VOCAB, (n - shared,), generator=generator).tolist() for n in lengths
    ]


@torch.inference_mode()
def hf_alone(model, prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
    """HF greedy on this prompt alone, from the model's state as loaded (dynamic rope keeps
    the frequencies of its longest call: a copy per prompt keeps earlier calls out)."""
    fresh = copy.deepcopy(model)
    out = fresh.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()
