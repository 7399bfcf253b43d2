"""Sizes an engine derives from its model and config: KV blocks, context length, EOS ids."""

from __future__ import annotations

import logging
from typing import Any

from actors.config import EngineConfig
from actors.kv_cache import kv_bytes_per_block
from actors.model_runner import model_geometry

logger = logging.getLogger(__name__)


def blocks_from_memory(model: Any, config: EngineConfig) -> int:
    """KV blocks that fit in `config.kv_cache_memory_gb` (K and V of every layer)."""
    num_layers, num_kv_heads, head_dim = model_geometry(model)
    dtype = next(model.parameters()).dtype
    per_block = kv_bytes_per_block(num_layers, config.block_size, num_kv_heads, head_dim, dtype)
    return max(1, int(config.kv_cache_memory_gb * 2**30 // per_block))


def max_model_len(model: Any, config: EngineConfig, num_blocks: int) -> int:
    """The context: the model's (or config's), never beyond the KV pool. A sliding window
    does not shorten it: every attention backend attends within each layer's window
    (`actors.attention`), and the cache keeps every block."""
    text = model.config.get_text_config()
    limit = config.max_model_len or dynamic_rope_context(text)
    limit = limit or getattr(text, "max_position_embeddings", None) or 2048
    return min(limit, num_blocks * config.block_size)


def dynamic_rope_context(text: Any) -> int | None:
    """A dynamic NTK rope model's context: `factor` x `max_position_embeddings`, the length
    vLLM derives for it (HF `generate` sets no limit: the scaling grows with the sequence,
    actors/rope.py); None for other rope types (longrope's context is max_position_embeddings
    itself). A larger `EngineConfig.max_model_len` is honoured."""
    params = getattr(text, "rope_parameters", None) or {}
    if params.get("rope_type") != "dynamic" or not params.get("factor"):
        return None
    context = int(float(params["factor"]) * int(text.max_position_embeddings))
    logger.info(
        "dynamic NTK rope: context %d tokens (factor x max_position_embeddings, as vLLM; "
        "EngineConfig.max_model_len sets another)",
        context,
    )
    return context


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Token ids that end generation: the model's generation config's EOS (one or a list)
    and the tokenizer's."""
    ids: set[int] = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (eos, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    return ids
