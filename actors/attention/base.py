"""The attention-backend seam: what a backend is given (`StepBatch`), what it implements
(`AttentionBackend`: `prepare` once per step, `forward` once per layer), and the object every
layer receives for the step (`AttentionMetadata`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import torch

KVCaches = list[
    tuple[torch.Tensor, torch.Tensor]
]  # per layer, [num_blocks, block_size, kv_heads, dim]
M = TypeVar("M")


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention computes, as transformers hands it to the attention
    function: the score scale (the model's `scaling`, e.g. Gemma 2's query_pre_attn_scalar),
    its sliding window and its logit softcap. Hugging Face's semantics, matched exactly:
    a query at position p sees the keys at positions p - window < k <= p
    (`masking_utils.sliding_window_overlay`; flash-attn's `window_size=(window - 1, 0)`), and
    a score s becomes `softcap * tanh(s / softcap)` before the mask and softmax (Gemma 2's
    `attn_logit_softcapping`)."""

    scale: float
    window: int | None = None  # None: full causal attention
    softcap: float | None = None  # None: scores as they are

    def __post_init__(self) -> None:
        assert self.window is None or self.window >= 1, self.window
        assert self.softcap is None or self.softcap > 0, self.softcap

    def first_key(self, position: int) -> int:
        """The first key position a query at `position` sees."""
        return 0 if self.window is None else max(0, position - self.window + 1)


@dataclass(frozen=True)
class StepBatch:
    """Some requests of one step, in the order of their rows in the step's flat sequence.

    The step puts its decodes (one new token after cached ones) first (`actors.step_layout`);
    `decodes()` and `prefills()` split it in two, each keeping its rows' place in the step.
    """

    num_cached: np.ndarray  # [num_reqs] int64: tokens already in the cache
    num_new: np.ndarray  # [num_reqs] int64: tokens this step computes
    block_tables: list[list[int]]  # [num_reqs] each request's KV blocks
    cu_seqlens_q: np.ndarray  # [num_reqs + 1] request i owns rows cu[i] .. cu[i + 1] - 1
    num_decodes: int  # the first num_decodes requests are decodes
    block_size: int

    def __post_init__(self) -> None:
        n = len(self.num_new)
        assert len(self.num_cached) == len(self.block_tables) == n == len(self.cu_seqlens_q) - 1
        assert 0 <= self.num_decodes <= n

    @property
    def num_reqs(self) -> int:
        """Requests in the batch."""
        return len(self.num_new)

    @property
    def rows(self) -> slice:
        """The batch's rows in the step's flat sequence."""
        return slice(int(self.cu_seqlens_q[0]), int(self.cu_seqlens_q[-1]))

    def decodes(self) -> StepBatch:
        """The decodes alone."""
        return self._part(0, self.num_decodes)

    def prefills(self) -> StepBatch:
        """Everything after the decodes: prefill chunks, whole prompts, extends of a prefix."""
        return self._part(self.num_decodes, self.num_reqs)

    def _part(self, start: int, stop: int) -> StepBatch:
        return StepBatch(
            self.num_cached[start:stop],
            self.num_new[start:stop],
            self.block_tables[start:stop],
            self.cu_seqlens_q[start : stop + 1],
            max(0, min(self.num_decodes, stop) - start),
            self.block_size,
        )


class AttentionBackend(ABC, Generic[M]):
    """Attention over the paged KV cache for the requests of a `StepBatch`.

    Built once per engine (or parallel worker) from the KV tensors it reads, and then holds
    no per-step state, so one backend serves every step and several engines can share a
    process. `prepare` turns a step's batch into metadata of type `M` once per step; the
    model's layers then call `forward` with it, once per layer.
    """

    def __init__(self, kv_caches: KVCaches) -> None:
        self.kv_caches = (
            kv_caches  # the engine's own list: a pipeline stage's other layers are empty
        )
        owned = [k for k, _ in kv_caches if k.dim() == 4]
        if not owned:
            raise ValueError("an attention backend needs at least one layer's KV cache")
        self.device = owned[0].device
        self.dtype = owned[0].dtype
        self.cache_shape = tuple(owned[0].shape)  # [num_blocks, block_size, kv_heads, dim]

    @abstractmethod
    def prepare(self, batch: StepBatch) -> M:
        """The step's metadata for `batch`: index tensors on the backend's device, checked
        here so `forward` need not check them per layer. Changes neither the backend nor
        the cache."""

    @abstractmethod
    def forward(
        self,
        meta: M,
        layer: int,
        query: torch.Tensor,  # [1, heads, num_tokens, dim], every row of the step
        key: torch.Tensor,  # [1, kv_heads, num_tokens, dim] the step's new keys
        value: torch.Tensor,  # [1, kv_heads, num_tokens, dim]
        params: LayerAttention,
        out: torch.Tensor,  # [num_tokens, heads, dim]
    ) -> None:
        """Attend the rows of `meta`'s requests in `layer`, writing those rows of `out` and
        nothing else. Reads the layer's cache, which already holds the step's new K/V
        (`paged_attention` writes them before calling any backend)."""


class HybridBackend(AttentionBackend[tuple[Any, Any]]):
    """A step's decodes by one backend and the rest of the step by another (the C kernel
    or gathered SDPA for decodes, SDPA per segment for prefill chunks)."""

    def __init__(self, decode: AttentionBackend[Any], prefill: AttentionBackend[Any]) -> None:
        super().__init__(prefill.kv_caches)
        self.decode = decode
        self.prefill = prefill

    def prepare(self, batch: StepBatch) -> tuple[Any, Any]:
        """Each part's metadata, None for an empty part."""
        decodes, prefills = batch.decodes(), batch.prefills()
        return (
            self.decode.prepare(decodes) if decodes.num_reqs else None,
            self.prefill.prepare(prefills) if prefills.num_reqs else None,
        )

    def forward(
        self,
        meta: tuple[Any, Any],
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        params: LayerAttention,
        out: torch.Tensor,
    ) -> None:
        """The decode part's rows, then the prefill part's."""
        decode_meta, prefill_meta = meta
        if decode_meta is not None:
            self.decode.forward(decode_meta, layer, query, key, value, params, out)
        if prefill_meta is not None:
            self.prefill.forward(prefill_meta, layer, query, key, value, params, out)


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's attention, handed to every layer through the model's forward kwargs: where
    the step's new K/V go, the backend, and what its `prepare` returned for the step."""

    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot of each new token
    backend: AttentionBackend[Any]
    prepared: Any

    @classmethod
    def build(
        cls, backend: AttentionBackend[Any], batch: StepBatch, slot_mapping: np.ndarray
    ) -> AttentionMetadata:
        """Prepare the step once (for all layers)."""
        return cls(device_tensor(slot_mapping, backend.device), backend, backend.prepare(batch))


def device_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A numpy array as a contiguous tensor on `device`."""
    array = np.ascontiguousarray(array)
    if not array.flags.writeable:  # a tp/pp worker's step plan, read from Ray's object store
        array = array.copy()  # torch warns on (and must not write into) a read-only array
    return torch.from_numpy(array).to(device)
