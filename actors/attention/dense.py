"""Attention over K/V already gathered into dense tensors, for the SDPA backends (and the
varlen backend's softcapped layers): torch SDPA, or the eager computation Hugging Face runs
when a layer softcaps its logits (SDPA has no softcap), and the masks for a sliding window.

Hand-written because no torch attention on CPU takes a softcap (SDPA, flash-for-CPU and
varlen have no argument for it; flex attention's `score_mod` does, but compiles per shape).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from actors.attention.base import LayerAttention

QUERY_CHUNK = 1024  # query rows per eager matmul: bounds the float32 score matrix


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """True where a query at `q_pos` sees a key at `k_pos` (broadcast against each other):
    causal, and within the window when there is one (Hugging Face's
    `sliding_window_causal_mask_function`: key > query - window)."""
    seen = k_pos <= q_pos
    if window is not None:
        seen &= k_pos > q_pos - window
    return seen


def segment_mask(
    num_cached: int, num_new: int, first_key: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """`[num_new, num_cached + num_new - first_key]`: rows at positions num_cached ..,
    keys from position `first_key` on."""
    rows = torch.arange(num_cached, num_cached + num_new, device=device)
    keys = torch.arange(first_key, num_cached + num_new, device=device)
    return visible(rows[:, None], keys[None, :], window)


def attend(
    q: torch.Tensor,  # [batch, heads, n, dim]
    k: torch.Tensor,  # [batch, kv_heads, keys, dim]
    v: torch.Tensor,  # [batch, kv_heads, keys, dim]
    mask: torch.Tensor | None,  # bool, broadcast to [batch, heads, n, keys]; True: attend
    params: LayerAttention,
    causal: bool = False,  # no mask: causal over fresh K/V (keys == n)
) -> torch.Tensor:
    """`[batch, heads, n, dim]` in q's dtype: SDPA when the layer has no softcap, else the
    eager softcapped softmax in float32."""
    if params.softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=params.scale, enable_gqa=True
        )
    if causal:
        assert mask is None
        mask = segment_mask(0, q.shape[2], 0, None, q.device)
    group = q.shape[1] // k.shape[1]
    k32 = k.float().repeat_interleave(group, dim=1)  # as transformers' repeat_kv
    v32 = v.float().repeat_interleave(group, dim=1)
    out = torch.empty_like(q)
    for start in range(0, q.shape[2], QUERY_CHUNK):
        rows = slice(start, start + QUERY_CHUNK)
        scores = torch.matmul(q[:, :, rows].float(), k32.transpose(-1, -2)) * params.scale
        scores = torch.tanh(scores / params.softcap) * params.softcap
        if mask is not None:
            part = mask[..., rows, :] if mask.shape[-2] > 1 else mask
            scores = scores.masked_fill(~part, float("-inf"))
        out[:, :, rows] = torch.matmul(torch.softmax(scores, dim=-1), v32).to(q.dtype)
    return out
