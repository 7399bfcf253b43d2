"""Comparison prefill modes: HF-style padded batches and Prepacking's 2-D bins.

The engine's own prefill (`varlen`) packs a step into one flat sequence with no padding. These
two modes exist to measure it against the usual alternatives (`benchmarks/bench_prefill.py`):

- `padded`: full batching as Hugging Face does it: one row per prompt, padded to the longest
  (left by default, as `generate` does for decoder-only models), a 2-D attention mask from which
  transformers builds the 4-D one, and position ids that start at each prompt's first token.
- `prepack`: Prepacking (arXiv 2404.09529): prompts go into first-fit-decreasing bins of
  `capacity` tokens (default: the longest prompt); each bin is one row with position ids
  restarting at 0 per prompt and a block-diagonal causal mask, so every prompt sees exactly
  what it would see alone.

Both take an HF causal LM and token-id lists and return, per prompt, the logits at its last
token and its K/V in every layer (views into the batch's `DynamicCache`), so a benchmark can
time the prefill alone, and `write_kv` can copy the K/V into a paged cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from transformers import DynamicCache

from packing.bins import pack
from packing.layout import block_diagonal_causal_mask, cu_seqlens, restart_positions, token_slots

PrefillMode = Literal["padded", "prepack"]
PaddingSide = Literal["left", "right"]
KV = tuple[torch.Tensor, torch.Tensor]  # (k, v), each [num_kv_heads, prompt_len, head_dim]


@dataclass(frozen=True)
class PrefillResult:
    """Per-prompt results of one batched prefill, in the order the prompts were given."""

    logits: torch.Tensor  # [num_prompts, vocab] float32, at each prompt's last token
    kv: list[list[KV]]  # kv[prompt][layer]
    num_computed_tokens: int  # rows x row width: what the model computed, padding included
    num_prompt_tokens: int  # the real tokens

    @property
    def padding_fraction(self) -> float:
        """Fraction of computed tokens that were padding."""
        return 1.0 - self.num_prompt_tokens / max(self.num_computed_tokens, 1)


@contextmanager
def dense_attention(model: Any) -> Iterator[None]:
    """Run the block with an attention implementation that takes dense masks and a
    `DynamicCache` (`sdpa`, or `eager` when the model already uses it).

    The engine switches its model to `raypack_paged`, which needs per-step metadata; the
    modes share that model, so they switch to `sdpa` for the call and back afterwards
    (a cheap attribute change, tens of microseconds).
    """
    current = model.config._attn_implementation
    if current in ("sdpa", "eager"):
        yield
        return
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(current)


def padded_prefill(
    model: Any, prompts: Sequence[Sequence[int]], padding_side: PaddingSide = "left"
) -> PrefillResult:
    """HF-style full batching: one padded row per prompt, then each prompt's K/V cut out."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    lengths = _lengths(prompts)
    width = max(lengths)
    pad_id = _pad_id(model)
    ids = np.full((len(prompts), width), pad_id, dtype=np.int64)  # [rows, width]
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    starts = [width - n if padding_side == "left" else 0 for n in lengths]
    for row, (prompt, start) in enumerate(zip(prompts, starts, strict=True)):
        ids[row, start : start + len(prompt)] = prompt
        mask[row, start : start + len(prompt)] = 1
    # Positions count real tokens only (as `generate` does); pads get 0 and are masked anyway.
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    places = [(row, start, n) for row, (start, n) in enumerate(zip(starts, lengths, strict=True))]
    return _run(model, ids, positions, torch.from_numpy(mask), places)


def prepack_prefill(
    model: Any, prompts: Sequence[Sequence[int]], capacity: int | None = None
) -> PrefillResult:
    """Prepacking: FFD bins, one row each, restart positions and a block-diagonal mask."""
    lengths = _lengths(prompts)
    capacity = max(lengths) if capacity is None else capacity
    if capacity < max(lengths):
        raise ValueError(f"capacity {capacity} is shorter than the longest prompt ({max(lengths)})")
    bins = pack(lengths, capacity, method="ffd")
    # Rows are as wide as the fullest bin (never more than capacity): extra width is pure waste.
    width = max(sum(lengths[i] for i in b) for b in bins)
    ids = np.full((len(bins), width), _pad_id(model), dtype=np.int64)  # [rows, width]
    positions = np.zeros((len(bins), width), dtype=np.int64)
    allowed = np.zeros((len(bins), 1, width, width), dtype=bool)  # [rows, 1, width, width]
    places: list[tuple[int, int, int]] = [(0, 0, 0)] * len(prompts)
    for row, members in enumerate(bins):
        # The tail padding is one more segment, so no query row is fully masked.
        segments = [lengths[i] for i in members] + [width - sum(lengths[i] for i in members)]
        segments = [n for n in segments if n > 0]
        positions[row] = restart_positions(segments)
        allowed[row, 0] = block_diagonal_causal_mask(segments)
        # zip stops before the tail padding's segment.
        for i, start in zip(members, cu_seqlens(segments)[:-1], strict=False):
            ids[row, start : start + lengths[i]] = prompts[i]
            places[i] = (row, int(start), lengths[i])
    return _run(model, ids, positions, _additive(torch.from_numpy(allowed), model), places)


def length_ordered_prefill(
    model: Any, prompts: Sequence[Sequence[int]], batch_size: int
) -> PrefillResult:
    """The sort-and-chunk baseline: prompts by length, padded batches of `batch_size`."""
    lengths = _lengths(prompts)
    chunks = pack(lengths, sum(lengths), method="length_ordered", batch_size=batch_size)
    return _merge(prompts, chunks, lambda part: padded_prefill(model, part))


def solo_prefill(model: Any, prompts: Sequence[Sequence[int]]) -> PrefillResult:
    """Each prompt alone (no padding, no batching): the reference and the loop baseline."""
    chunks = [[i] for i in range(len(prompts))]
    return _merge(prompts, chunks, lambda part: padded_prefill(model, part))


def prefill(
    model: Any, prompts: Sequence[Sequence[int]], mode: PrefillMode | str, **options: Any
) -> PrefillResult:
    """Dispatch to `padded_prefill` or `prepack_prefill` by mode name."""
    if mode == "padded":
        return padded_prefill(model, prompts, **options)
    if mode == "prepack":
        return prepack_prefill(model, prompts, **options)
    raise ValueError(f"mode must be 'padded' or 'prepack', got {mode!r}")


@torch.inference_mode()
def write_kv(
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    kv: Sequence[KV],
    block_ids: Sequence[int],
    block_size: int,
) -> None:
    """Copy one prompt's per-layer K/V into a paged cache (positions 0 .. len - 1 of the
    request whose block table is `block_ids`)."""
    num_tokens = kv[0][0].shape[1]
    slots = torch.from_numpy(token_slots(block_ids, num_tokens, block_size))
    slots = slots.to(kv_caches[0][0].device)
    for (k_cache, v_cache), (k, v) in zip(kv_caches, kv, strict=True):
        heads, dim = k_cache.shape[2:]  # [num_blocks, block_size, kv_heads, dim]
        k_cache.view(-1, heads, dim).index_copy_(0, slots, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.view(-1, heads, dim).index_copy_(0, slots, v.transpose(0, 1).to(v_cache.dtype))


# ---- internals ----------------------------------------------------------------------------


def _lengths(prompts: Sequence[Sequence[int]]) -> list[int]:
    if not prompts:
        raise ValueError("need at least one prompt")
    lengths = [len(p) for p in prompts]
    if min(lengths) < 1:
        raise ValueError(f"prompt {lengths.index(0)} is empty")
    return lengths


def _pad_id(model: Any) -> int:
    pad = getattr(model.config, "pad_token_id", None)
    return int(pad) if isinstance(pad, int) else 0  # any id works: pads are masked out


def _additive(allowed: torch.Tensor, model: Any) -> torch.Tensor:
    """A bool mask as an additive float one (0 / finfo.min). `eager` attention adds a bool
    mask to the scores as 0/1 (silently wrong), and `sdpa` is as fast or faster with floats."""
    dtype = next(model.parameters()).dtype
    mask = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype)
    return mask.masked_fill_(allowed, 0.0)


@torch.inference_mode()
def _run(
    model: Any,
    ids: np.ndarray,
    positions: np.ndarray,
    attention_mask: torch.Tensor,
    places: Sequence[tuple[int, int, int]],
) -> PrefillResult:
    """One forward of `[rows, width]` inputs; `places[i] = (row, start, length)` of prompt i.

    The decoder runs with an explicit cache and mask (transformers' own packed-sequence
    detection is skipped when a cache is present), then the LM head only at the last token
    of each prompt.
    """
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    with dense_attention(model):
        hidden = (
            model.get_decoder()(
                input_ids=torch.from_numpy(ids).to(device),
                attention_mask=attention_mask.to(device),
                position_ids=torch.from_numpy(positions).to(device),
                past_key_values=cache,
                use_cache=True,
            )
        ).last_hidden_state  # [rows, width, hidden]
    rows = torch.tensor([row for row, _, _ in places], device=device)
    lasts = torch.tensor([start + n - 1 for _, start, n in places], device=device)
    logits = _lm_head(model, hidden[rows, lasts])  # [num_prompts, vocab]
    layers = _cache_kv(cache)
    kv = [[(k[row, :, s : s + n], v[row, :, s : s + n]) for k, v in layers] for row, s, n in places]
    return PrefillResult(logits, kv, int(ids.size), sum(n for _, _, n in places))


def _cache_kv(cache: DynamicCache) -> list[KV]:
    """Per layer (k, v) `[rows, kv_heads, width, head_dim]` of a filled cache."""
    out = []
    for index, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise ValueError(
                f"cache layer {index} ({type(layer).__name__}) holds no K/V tensors: "
                "the prefill modes need a model with attention in every layer"
            )
        out.append((keys, values))
    return out


def _lm_head(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    logits = model.get_output_embeddings()(hidden).float()
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    if cap:  # the causal-LM forward applies it after the head (Gemma 2 and kin)
        logits = torch.tanh(logits / cap) * cap
    result: torch.Tensor = logits
    return result


def _merge(
    prompts: Sequence[Sequence[int]],
    chunks: list[list[int]],
    run: Callable[[list[Sequence[int]]], PrefillResult],
) -> PrefillResult:
    """Run `run` on each chunk of prompt indices and put the results back in prompt order."""
    logits: list[torch.Tensor | None] = [None] * len(prompts)
    kv: list[list[KV]] = [[] for _ in prompts]
    computed = real = 0
    for chunk in chunks:
        part = run([prompts[i] for i in chunk])
        for j, i in enumerate(chunk):
            logits[i] = part.logits[j]
            kv[i] = part.kv[j]
        computed += part.num_computed_tokens
        real += part.num_prompt_tokens
    stacked = torch.stack([t for t in logits if t is not None])
    assert stacked.shape[0] == len(prompts), "every prompt is in exactly one chunk"
    return PrefillResult(stacked, kv, computed, real)
