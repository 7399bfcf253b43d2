"""The attention function transformers calls in every layer (`AttentionInterface` name
`raypack_paged`): it writes the step's new K/V into the paged cache, then hands the layer to
the step's backend."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface

from actors.attention.base import AttentionMetadata, LayerAttention

ATTN_NAME = "raypack_paged"
ATTN_KWARG = "raypack_attention"  # the model forward's keyword that carries AttentionMetadata


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, num_heads, num_tokens, head_dim]
    key: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_dim]
    value: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_dim]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Write the step's K/V into the paged cache and attend; returns
    `[1, num_tokens, num_heads, head_dim]` as transformers expects.

    The layer's `scaling`, `sliding_window` and `softcap` are what transformers passes every
    attention function (flash-attention's path reads them from the same keywords): Gemma 2/3
    and Qwen2 pass a window on their sliding layers only, Mistral on all, Gemma 2 its logit
    softcap. The causal `attention_mask` transformers builds is not read: each backend
    derives its masks from the step's layout and these numbers."""
    meta: AttentionMetadata | None = kwargs.get(ATTN_KWARG)
    if meta is None:
        raise RuntimeError(
            f"attention implementation {ATTN_NAME!r} needs the engine's per-step metadata; "
            "run this model through LLMEngine, or call "
            "model.set_attn_implementation('sdpa') to use it on its own"
        )
    layer = _layer_index(module)
    k_cache, v_cache = meta.backend.kv_caches[layer]  # [num_blocks, block_size, kv_heads, dim]
    _, _, num_kv_heads, head_dim = k_cache.shape
    k_new = key[0].transpose(0, 1)  # [num_tokens, kv_heads, dim]
    v_new = value[0].transpose(0, 1)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k_new)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v_new)
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [tokens, heads, dim]
    params = LayerAttention(
        scale=head_dim**-0.5 if scaling is None else float(scaling),
        window=kwargs.get("sliding_window") or None,
        softcap=kwargs.get("softcap") or None,
    )
    meta.backend.forward(meta.prepared, layer, query, key, value, params, out)
    return out.unsqueeze(0), None


def _layer_index(module: torch.nn.Module) -> int:
    index = getattr(module, "layer_idx", None)
    if not isinstance(index, int):
        raise TypeError(f"{type(module).__name__} has no integer layer_idx; cannot find its cache")
    return index


def register() -> None:
    """Register `paged_attention` with transformers under `raypack_paged` (idempotent; the
    registry maps a name to a pure function, nothing per engine is stored there)."""
    AttentionInterface.register(ATTN_NAME, paged_attention)
