"""Paged attention behind transformers' `AttentionInterface`, with backends behind one seam.

The model is an unmodified Hugging Face model; the engine switches its attention
implementation to `raypack_paged` (`function.paged_attention`) and passes the step's
`AttentionMetadata` through the forward's keyword argument `raypack_attention`. Per layer the
function writes the step's new K/V into the paged cache and calls the engine's backend with
the layer's `LayerAttention`: its scale, sliding window and logit softcap, as transformers
passes them (every backend honours all three, with Hugging Face's semantics).

A backend (`base.AttentionBackend`) is built once per engine from its KV tensors, prepares
each step's metadata once (`prepare`) and attends once per layer (`forward`):
- `cpu_kernel`: decodes by the compiled paged decode kernel (`kernel`, CPU float32), the rest
  of the step by SDPA per request (`sdpa.SdpaPrefillBackend`); with
  `EngineConfig.shared_prefix_attention` (on where the kernel has its AVX-512 run tiles)
  the decodes' shared blocks (a prefix group's, at every nesting level) are read once per
  step for all of them (`shared_prefix`);
- `sdpa`: decodes gathered by block table for SDPA (`sdpa.SdpaDecodeBackend`), the rest as
  above; runs on any device;
- `varlen`: the whole step in one flash varlen call (`varlen`, CUDA in bf16/fp16).
`select.make_backend` picks one from `EngineConfig.attention_backend` and the cache's device
and dtype ("auto": varlen, else cpu_kernel, else sdpa). Nothing is stored in module or class
state, so several engines can run in one process.

A new way to attend decodes is a decode backend in `HybridBackend`'s decode place, with what
it needs added to `StepBatch` (`shared_prefix` needed nothing: shared blocks are in the
block tables).
"""

from actors.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    HybridBackend,
    LayerAttention,
    StepBatch,
)
from actors.attention.function import ATTN_KWARG, ATTN_NAME, paged_attention, register
from actors.attention.sdpa import DECODE_CHUNK
from actors.attention.select import available_backends, make_backend, resolve_backend

__all__ = [
    "ATTN_KWARG",
    "ATTN_NAME",
    "DECODE_CHUNK",
    "AttentionBackend",
    "AttentionMetadata",
    "HybridBackend",
    "LayerAttention",
    "StepBatch",
    "available_backends",
    "make_backend",
    "paged_attention",
    "register",
    "resolve_backend",
]
