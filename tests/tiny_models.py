"""Tiny randomly initialised decoder models for tests (fixed seeds, CPU, float32).

Each uses the embedded SmolLM2 tokenizer (vocab 49152), so prompts are real text; the models
are small enough that a forward pass takes milliseconds. Their next token depends on the whole
context, not only on the last token: tests/test_tiny_models.py zeroes every layer's attention
and sees the greedy output change on every prompt the token-comparing tests use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from actors.loader import ensure_embedded_converted, load_tokenizer

VOCAB = 49152
LAYER_STD = 0.2  # layer matrices' init spread: attention really moves the logits

# (model_type, heads, kv heads, head_dim): GQA, an odd head count, and plain MHA.
ARCHS: dict[str, dict[str, int | str | bool]] = {
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "qwen2": dict(model_type="qwen2", num_attention_heads=3, num_key_value_heads=1, head_dim=16),
    "mistral": dict(model_type="mistral", num_attention_heads=5, num_key_value_heads=5, head_dim=8),
}


def tiny_config(
    arch: str = "llama",
    num_layers: int = 2,
    max_position_embeddings: int = 512,
    vocab_size: int = VOCAB,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    pad_token_id: int = 2,
):
    """A transformers config for a tiny model of the given architecture (the SmolLM2
    vocabulary unless told: tests/tiny_tokenizers.py gives a smaller one)."""
    spec = dict(ARCHS[arch])
    model_type = str(spec.pop("model_type"))
    heads = int(spec["num_attention_heads"])
    head_dim = int(spec["head_dim"])
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=heads * head_dim,
        intermediate_size=2 * heads * head_dim,
        num_hidden_layers=num_layers,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        **spec,
    )
    if model_type == "mistral":
        kwargs["sliding_window"] = None
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(arch: str = "llama", seed: int = 0, num_layers: int = 2, **vocab: int):
    """A tiny random model in eval mode (float32, CPU), the same for the same seed. `vocab`:
    tiny_config's vocab_size and special token ids, when not SmolLM2's.

    Transformers' default init (std 0.02) leaves attention's contribution to the logits around
    1e-3 next to the wide embeddings below, so a broken attention mask or KV cache could still
    give the right greedy tokens. Layer matrices drawn with std 0.2 make the context move the
    logits by about 0.5: token comparisons then test the attention and KV paths.
    """
    torch.manual_seed(seed)
    return model_from_config(tiny_config(arch, num_layers, **vocab))


def model_from_config(config: Any, attn_implementation: str = "sdpa") -> Any:
    """A random float32 model of `config` in eval mode, with `tiny_model`'s spread init (the
    same weights for the same torch seed beforehand)."""
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation=attn_implementation
    )
    # Random init gives near-uniform logits and many argmax ties; a wider embedding spread
    # makes greedy choices well separated so token comparisons are meaningful.
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0, 1.0)
        generator = torch.Generator().manual_seed(1)
        for param in model.model.layers.parameters():
            if param.dim() == 2:
                param.normal_(0.0, LAYER_STD, generator=generator)
    return model.eval()


def save_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, num_layers: int = 2) -> Path:
    """Write a tiny model plus the SmolLM2 tokenizer to `folder` (a loadable model path)."""
    folder = Path(folder)
    tiny_model(arch, seed, num_layers).save_pretrained(folder)
    ensure_embedded_converted()
    load_tokenizer("smollm2").save_pretrained(folder)
    return folder
