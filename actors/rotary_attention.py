"""Llama-style attention with fewer element-wise passes: q and k rotated in one go.

transformers' `LlamaAttention.forward` rotates q and k apart, each in seven tensor ops
(`q * cos + rotate_half(q) * sin`, `rotate_half` slicing, negating and concatenating), on the
heads-first transposed views. Per layer and step that is 14 passes over the step's q and k,
the bulk of the element-wise time left beside the matmuls (docs/benchmarks-peers.md). Here,
when q/k/v run as one fused matmul (actors/fused_linear.py), q and k are neighbours in its
output, and the rotation runs once over both: `qk * cos`, `roll(qk) * sin_signed`, the sum
(four ops), where `sin_signed` is sin with its first half negated, made once per step and
shared by the layers. Every element is the same IEEE product and sum as HF's
(`(-a) * b == a * (-b)` exactly), so the results are bit-identical.

With `FusedOps` (actors/kernels/fused.py) in the step's dtype, the rotation is one compiled
pass over q and k in place in the fused output (the same products and sums, the same bits),
where cos/sin are one contiguous row per token; else the four torch ops above.

Applied per module, only to attention modules whose forward is transformers'
`LlamaAttention.forward` itself (the same bytecode: llama, gemma, granite, qwen2_moe in
transformers 5; `modular` copies share it), whose q/k/v are fused and whose rotary covers
the whole head; every other module keeps its own forward.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama

from actors.cpu_linear import restore_forwards
from actors.fused_linear import FusedProjection
from actors.kernels.fused import FusedOps


def code_key(function: Any) -> tuple[Any, ...]:
    """What makes two Python functions the same code: bytecode, constants and names."""
    code = inspect.unwrap(function).__code__
    return code.co_code, code.co_consts, code.co_names, code.co_varnames


_LLAMA_ATTENTION = code_key(modeling_llama.LlamaAttention.forward)
_LLAMA_ROTARY = code_key(modeling_llama.apply_rotary_pos_emb)


class SignedSin:
    """sin with its first half negated, computed once per step's sin tensor: every layer of
    a forward gets the same `position_embeddings` object."""

    def __init__(self) -> None:
        self._sin: torch.Tensor | None = None
        self._signed: torch.Tensor | None = None

    def of(self, sin: torch.Tensor) -> torch.Tensor:
        if self._sin is not sin:
            half = sin.shape[-1] // 2
            self._signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            self._sin = sin
        assert self._signed is not None
        return self._signed


def is_llama_attention(module: torch.nn.Module) -> bool:
    """The module's forward is transformers' `LlamaAttention.forward` (and its module's
    `apply_rotary_pos_emb` is Llama's), and its q/k/v share one fused projection."""
    forward = getattr(type(module), "forward", None)
    if forward is None or code_key(forward) != _LLAMA_ATTENTION:
        return False
    rotary = getattr(inspect.getmodule(type(module)), "apply_rotary_pos_emb", None)
    if rotary is None or code_key(rotary) != _LLAMA_ROTARY:
        return False
    group = getattr(getattr(module, "q_proj", None), "_raypack_packed", None)
    return isinstance(group, FusedProjection) and group.members == 3


def install(model: torch.nn.Module, ops: FusedOps | None = None) -> int:
    """Give every Llama-style attention module of `model` (`is_llama_attention`) the
    one-pass rotary forward (the compiled one of `ops` where its dtype and the step's
    tensors fit); returns how many. `uninstall` undoes it."""
    signed = SignedSin()
    count = 0
    for module in model.modules():
        if is_llama_attention(module):
            module.forward = _forward(module, signed, ops)
            module._raypack_rotary = True  # type: ignore[assignment]
            count += 1
    return count


def uninstall(model: torch.nn.Module) -> None:
    """Every attention module back on its class's forward."""
    restore_forwards(model, "_raypack_rotary")


def _forward(module: Any, signed: SignedSin, ops: FusedOps | None) -> Callable[..., Any]:
    group: FusedProjection = module.q_proj._raypack_packed
    head_dim = module.head_dim
    q_width, k_width, _ = group.sizes
    qk_heads = (q_width + k_width) // head_dim
    fallback = type(module).forward

    def forward(
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        cos, sin = position_embeddings
        if past_key_values is not None or cos.shape[-1] != head_dim:
            return fallback(  # type: ignore[no-any-return]
                module,
                hidden_states,
                position_embeddings,
                attention_mask,
                past_key_values,
                **kwargs,
            )
        input_shape = hidden_states.shape[:-1]
        qkv = group.full(hidden_states)  # [..., q + k + v]
        heads_shape = (*input_shape, -1, head_dim)
        if _fits(ops, qkv, cos, sin, input_shape, head_dim):
            assert ops is not None
            ops.rotary(qkv.view(-1, qkv.shape[-1]), qk_heads, head_dim, cos, sin)
            rotated = qkv[..., : q_width + k_width].view(heads_shape)  # [b, n, q + k heads, dim]
        else:
            qk = qkv[..., : q_width + k_width].view(heads_shape)  # [b, n, q + k heads, dim]
            cos, sin = cos.unsqueeze(-2), signed.of(sin).unsqueeze(-2)  # [b, n, 1, dim]
            rotated = qk * cos
            rotated += torch.roll(qk, head_dim // 2, dims=-1).mul_(sin)
        query = rotated[..., : q_width // head_dim, :].transpose(1, 2)
        key = rotated[..., q_width // head_dim :, :].transpose(1, 2)
        value = qkv[..., q_width + k_width :].view(heads_shape).transpose(1, 2)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            module.config._attn_implementation, modeling_llama.eager_attention_forward
        )
        out, weights = interface(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not module.training else module.attention_dropout,
            scaling=module.scaling,
            **kwargs,
        )
        out = out.reshape(*input_shape, -1).contiguous()
        return module.o_proj(out), weights

    return forward


def _fits(
    ops: FusedOps | None,
    qkv: torch.Tensor,  # [b, n, q + k + v]
    cos: torch.Tensor,  # [b, n, head_dim]
    sin: torch.Tensor,
    input_shape: torch.Size,
    head_dim: int,
) -> bool:
    """The compiled rotary applies: its dtype, every tensor contiguous, one cos/sin row per
    token (no broadcast over a batch), an even head_dim."""
    return (
        ops is not None
        and qkv.dtype == cos.dtype == sin.dtype == ops.dtype
        and head_dim % 2 == 0
        and tuple(cos.shape) == (*input_shape, head_dim)
        and sin.shape == cos.shape
        and qkv.is_contiguous()
        and cos.is_contiguous()
        and sin.is_contiguous()
    )
