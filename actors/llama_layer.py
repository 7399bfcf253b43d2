"""Llama-style decoder layers in one Python function, with fewer fresh tensors.

transformers' `LlamaDecoderLayer.forward` calls eight modules per layer (two RMSNorms, the
attention, its projections, the MLP's three linears and its activation), each through
`nn.Module.__call__`, and allocates a fresh tensor for every intermediate (the norm's
`variance + eps` and `rsqrt`, both residual sums, the SiLU product). Here one function does
the same arithmetic on the same operands: the norm's eps and rsqrt and the weight product in
place, the residuals added into the fresh sublayer outputs (`a + b == b + a` in IEEE), SiLU
and its product in place on the fresh gate output. Every element is the same rounded result,
so the tokens are bit-identical (tested against transformers' layer).

Applied per layer, only where all of it is transformers' Llama code: the layer's forward is
`LlamaDecoderLayer.forward` (the same bytecode), its norms' forwards `LlamaRMSNorm.forward`,
its MLP's `LlamaMLP.forward` with SiLU, its attention the one-pass rotary forward
(actors/rotary_attention.py), no hooks on any of them, the norms' weights in the layer's
dtype (float32, bfloat16 or float16); anything else keeps transformers' forward. In half
precision the norm computes in float32 as transformers' does (the upcast copy is fresh, so
its rsqrt product runs in place) and rounds once to the layer's dtype before the weight.

With `FusedOps` (actors/kernels/fused.py, float32 and bfloat16 on CPU) each norm, and the
residual add before the second one, is one compiled pass instead of 6-9 torch ops, the same
bits (its sum of squares adds in torch's order; a width where no order is found keeps torch's
ops).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.models.llama import modeling_llama

from actors.cpu_linear import restore_forwards
from actors.kernels.fused import FusedOps
from actors.rotary_attention import code_key

_LAYER = code_key(modeling_llama.LlamaDecoderLayer.forward)
_NORM = code_key(modeling_llama.LlamaRMSNorm.forward)
_MLP = code_key(modeling_llama.LlamaMLP.forward)


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _plain(module: Any, key: tuple[Any, ...]) -> bool:
    forward = getattr(type(module), "forward", None)
    return (
        forward is not None
        and code_key(forward) == key
        and "forward" not in vars(module)
        and not module._forward_hooks
        and not module._forward_pre_hooks
    )


def is_llama_layer(layer: torch.nn.Module) -> bool:
    """Everything `install` replaces is transformers' Llama code, unhooked, its norms'
    weights in the dtype of its MLP's."""
    forward = getattr(type(layer), "forward", None)
    if forward is None or code_key(forward) != _LAYER or layer._forward_hooks:
        return False
    norms = [
        getattr(layer, "input_layernorm", None),
        getattr(layer, "post_attention_layernorm", None),
    ]
    mlp = getattr(layer, "mlp", None)
    attn = getattr(layer, "self_attn", None)
    dtype = getattr(getattr(getattr(mlp, "down_proj", None), "weight", None), "dtype", None)
    return (
        dtype in _DTYPES
        and all(n is not None and _plain(n, _NORM) and n.weight.dtype == dtype for n in norms)
        and mlp is not None
        and _plain(mlp, _MLP)
        and type(mlp.act_fn).__name__ in ("SiLUActivation", "SiLU")
        and attn is not None
        and hasattr(attn, "_raypack_rotary")
        and not attn._forward_hooks
        and not attn._forward_pre_hooks
        and not any(
            m._forward_hooks or m._forward_pre_hooks
            for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj, attn.o_proj)
        )
    )


def install(model: torch.nn.Module, ops: FusedOps | None = None) -> int:
    """Give every `is_llama_layer` layer of `model` the one-function forward (its norms
    the compiled ones of `ops` where their dtype is its and they match torch's bits); how
    many."""
    if torch.nn.modules.module._global_forward_hooks or (
        torch.nn.modules.module._global_forward_pre_hooks
    ):
        return 0  # a global hook must see every module call
    count = 0
    for module in model.modules():
        if is_llama_layer(module):
            module.forward = _forward(module, ops)
            module._raypack_layer = True  # type: ignore[assignment]
            count += 1
    return count


def uninstall(model: torch.nn.Module) -> None:
    """Every layer back on its class's forward."""
    restore_forwards(model, "_raypack_layer")


def _rms_norm(norm: Any, ops: FusedOps | None) -> Callable[..., torch.Tensor]:
    """The norm of `x` (after `x += residual`, in place, when a residual is given)."""
    weight, eps = norm.weight, norm.variance_epsilon
    lanes = None
    if ops is not None and ops.dtype == weight.dtype and weight.dim() == 1:
        lanes = ops.norm_lanes(weight.shape[0], eps)  # None: not torch's bits, torch's ops
    fused = lanes is not None and weight.is_contiguous()

    def forward(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if (
            fused
            and x.dtype == weight.dtype
            and x.is_contiguous()
            and (residual is None or (residual.is_contiguous() and residual.shape == x.shape))
        ):
            assert ops is not None and lanes is not None
            return ops.rms_norm(x, weight, eps, lanes, residual)
        if residual is not None:
            x += residual
        if x.dtype != weight.dtype:
            return norm(x)  # type: ignore[no-any-return]
        if x.dtype == torch.float32:
            variance = x.pow(2).mean(-1, keepdim=True)
            variance += eps
            out = x * variance.rsqrt_()
        else:  # transformers: in float32, then one rounding to the input's dtype
            wide = x.to(torch.float32)
            variance = wide.pow(2).mean(-1, keepdim=True)
            variance += eps
            wide *= variance.rsqrt_()
            out = wide.to(x.dtype)
        out *= weight
        return out

    return forward


def _forward(layer: Any, ops: FusedOps | None) -> Callable[..., torch.Tensor]:
    input_norm = _rms_norm(layer.input_layernorm, ops)
    post_norm = _rms_norm(layer.post_attention_layernorm, ops)
    attention = layer.self_attn.forward
    gate, up, down = (
        layer.mlp.gate_proj.forward,
        layer.mlp.up_proj.forward,
        layer.mlp.down_proj.forward,
    )

    def forward(
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        attended, _ = attention(
            hidden_states=input_norm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        normed = post_norm(attended, hidden_states)  # attended += the residual, in place
        act = torch.nn.functional.silu(gate(normed), inplace=True)
        act *= up(normed)
        out: torch.Tensor = down(act)
        out += attended  # the residual
        return out

    return forward
