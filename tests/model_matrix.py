"""The test matrix's tiny random models, one per architecture (and rope variant) the engine
runs: scaled-down configs with fixed seeds, saved with `save_pretrained` into a folder the
engine loads as a user's model (`EngineConfig(model=folder)`).

Sliding windows are out of this matrix: configs that carry one by default (mistral, gemma2,
gemma3_text) set it to the whole context or none, so the window never cuts (the sliding-window
tests are the attention backends'). Gemma 2 keeps its final logit softcapping (transformers
applies it in the LM head) but not attention softcapping, and its `query_pre_attn_scalar` is
the head dim; both refused otherwise (actors/architectures.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from actors.loader import ensure_embedded_converted, load_tokenizer
from tests.tiny_models import LAYER_STD, VOCAB

CONTEXT = 512
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
_YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
}
_NO_WINDOW = {"sliding_window": CONTEXT}  # the window is the whole context: it never cuts

# name -> (model_type, config fields beside the common ones)
MATRIX: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"num_key_value_heads": 2}),
    "llama3_rope": ("llama", {"num_key_value_heads": 2, "rope_parameters": _LLAMA3_ROPE}),
    "mistral": ("mistral", {"num_key_value_heads": 2, "sliding_window": None}),
    "qwen2": ("qwen2", {"num_key_value_heads": 1}),
    "qwen2_yarn": ("qwen2", {"num_key_value_heads": 1, "rope_parameters": _YARN_ROPE}),
    "qwen3": ("qwen3", {"num_key_value_heads": 2}),
    "gemma": ("gemma", {"num_key_value_heads": 1}),
    "gemma2": (
        "gemma2",
        {
            "num_key_value_heads": 2,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": 5.0,  # small: the cap really bends the logits
            "query_pre_attn_scalar": 16,
            **_NO_WINDOW,
        },
    ),
    "gemma3_text": (
        "gemma3_text",
        {"num_key_value_heads": 2, "query_pre_attn_scalar": 16, **_NO_WINDOW},
    ),
    "phi3": ("phi3", {"num_key_value_heads": 2}),
    "olmo2": ("olmo2", {"num_key_value_heads": 2}),
    "granite": ("granite", {"num_key_value_heads": 2}),
    "starcoder2": ("starcoder2", {"num_key_value_heads": 2}),
    "gpt_neox": ("gpt_neox", {}),
    "gpt2": ("gpt2", {}),
    "qwen2_moe": (
        "qwen2_moe",
        {
            "num_key_value_heads": 2,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
    ),
    "mixtral": ("mixtral", {"num_key_value_heads": 2, "num_local_experts": 4}),
}


def matrix_config(name: str, num_layers: int = 2, **extra: Any) -> Any:
    """The tiny config of matrix entry `name` (4 heads of 16, SmolLM2's vocabulary), with
    `extra` fields on top (the gate's tests add refused features to it)."""
    model_type, fields = MATRIX[name]
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        head_dim=16,
        num_hidden_layers=num_layers,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    kwargs.update(fields)
    kwargs.update(extra)
    return AutoConfig.for_model(model_type, **kwargs)


def matrix_model(name: str, seed: int = 0, **extra: Any) -> Any:
    """A tiny random model of matrix entry `name` in eval mode (float32, CPU), the same for the
    same seed. As tests/tiny_models.py does, the embeddings are drawn with std 1 and every
    layer matrix with std 0.2, so the context really moves the logits."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(matrix_config(name, **extra), dtype=torch.float32)
    embeddings = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0, 1.0)
        for name_, param in model.named_parameters():
            if param.dim() == 2 and id(param) not in embeddings and "wpe" not in name_:
                param.normal_(0.0, LAYER_STD, generator=generator)  # wpe: gpt2's positions
    return model.eval()


def save_matrix_model(folder: Path, name: str, seed: int = 0, **extra: Any) -> Path:
    """Write matrix entry `name` plus the SmolLM2 tokenizer to `folder`; the folder."""
    folder = Path(folder)
    matrix_model(name, seed, **extra).save_pretrained(folder)
    ensure_embedded_converted()
    load_tokenizer("smollm2").save_pretrained(folder)
    return folder
