"""Rotary embeddings whose frequencies depend on the sequence length, computed per request.

transformers' `longrope` (Phi-3/Phi-4 long context) and `dynamic` NTK rotary embeddings choose
their inverse frequencies from the largest position of the whole forward
(`dynamic_rope_update` in transformers' modeling_rope_utils). Our step is one flat sequence of
several requests, so left alone a short request packed with a long one gets the long one's
frequencies. Here each token gets the frequencies HF `generate` would use for its request
alone at that point of its generation:

- the prompt is one HF forward: every prompt token (every chunk of a chunked prefill) uses the
  frequencies of a forward of the whole prompt, so its "rope length" is the prompt's length;
- each decode is a forward of one token at position p: rope length p + 1.

So a token at position p of a request whose prompt has L tokens has rope length max(L, p + 1)
(`Request.rope_len` is L), also when a preempted request is recomputed. The frequencies of a
rope length s: `longrope`, the long factors when s > original_max_position_embeddings, else
the short ones; `dynamic`, NTK scaled for s when s > max_position_embeddings, else the
original ones (HF's `generate` on one prompt alone grows its frequencies step by step and
never keeps ones of a longer earlier call). Cached keys keep the frequencies they were
computed with, as in HF, which does not recompute them either.

Phi-3's own `prepare_inputs_for_generation` (phi3, phimoe, phi4_multimodal) is the exception:
when a sequence first grows past `original_max_position_embeddings` it drops its KV cache and
recomputes the whole sequence in one forward (long factors everywhere). The engine does the
same (`RopePolicy.restarts`): the request is freed and recomputed with rope length
`original_max_position_embeddings + 1`.

Plain rope types (default, linear, llama3, yarn...) have no policy: no per-request work.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# Models whose `prepare_inputs_for_generation` recomputes the whole sequence when it first
# grows past `config.original_max_position_embeddings` (transformers' phi3 family).
RECOMPUTE_ON_CROSSING = frozenset({"phi3", "phimoe", "phi4_multimodal"})


@dataclass(frozen=True)
class RopePolicy:
    """How a model's rope frequencies depend on the sequence length (None: they do not)."""

    rope_type: str  # "longrope" or "dynamic"
    threshold: int  # rope lengths above it scale
    restart_after: int | None  # a sequence growing past this is recomputed (phi3), else None

    @classmethod
    def of(cls, model: Any) -> RopePolicy | None:
        """The policy of a transformers model, None for rope types that ignore the length.
        ValueError for a length-dependent rope this engine cannot run per request."""
        text = model.config.get_text_config()
        params = getattr(text, "rope_parameters", None) or {}
        rope_type = str(params.get("rope_type", "default"))
        if rope_type not in ("longrope", "dynamic") and not any(
            isinstance(p, dict) and p.get("rope_type") in ("longrope", "dynamic")
            for p in params.values()
        ):
            return None
        model_type = getattr(text, "model_type", "?")
        if rope_type not in ("longrope", "dynamic"):
            raise ValueError(
                f"{model_type}: rope_type longrope/dynamic per layer type is not supported"
            )
        rotary = rotary_module(model)
        if isinstance(rotary, RequestRotary):  # a second engine over the same model
            rotary = rotary.inner
        if rotary is None or not all(
            hasattr(rotary, name) for name in ("inv_freq", "original_inv_freq", "config")
        ):
            raise ValueError(
                f"{model_type}: {rope_type} rope needs transformers' rotary_emb module "
                "(inv_freq, original_inv_freq) to be computed per request"
            )
        if rope_type == "longrope":
            threshold = int(params["original_max_position_embeddings"])
        else:
            threshold = int(text.max_position_embeddings)
        restart = None
        if model_type in RECOMPUTE_ON_CROSSING and hasattr(
            text, "original_max_position_embeddings"
        ):
            restart = int(text.original_max_position_embeddings)
        return cls(rope_type, threshold, restart)

    def cache_salt(self, rope_len: int) -> int | None:
        """What a request's KV blocks depend on beyond their tokens (the prefix cache's and
        prefix groups' key): longrope, whether the prompt is long; dynamic, a prompt past
        the threshold's own length (its frequencies are its own)."""
        if rope_len <= self.threshold:
            return None
        return 1 if self.rope_type == "longrope" else rope_len

    def restarts(self, num_tokens: int, num_computed: int, rope_len: int) -> bool:
        """True when HF would now drop the cache and recompute (phi3 crossing its original
        context): the sequence just reached restart_after + 1 tokens, its KV not yet long."""
        limit = self.restart_after
        return (
            limit is not None
            and num_tokens == limit + 1
            and num_computed == limit
            and rope_len <= limit
        )

    def frequency_keys(self, rope_lens: torch.Tensor) -> torch.Tensor:
        """Per token, which frequencies it uses: 0 the model's original ones, else longrope
        1 (long factors), dynamic the rope length they are scaled for."""
        scaled = rope_lens > self.threshold
        if self.rope_type == "longrope":
            return scaled.long()
        return torch.where(scaled, rope_lens, 0)


def rotary_module(model: Any) -> nn.Module | None:
    """The decoder's rotary embedding module (`model.model.rotary_emb` in transformers)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    return getattr(decoder, "rotary_emb", None)


def token_rope_lens(
    rope_lens: np.ndarray, num_new: np.ndarray, positions: np.ndarray
) -> np.ndarray:
    """Each token's rope length, max(its request's `rope_len`, position + 1)."""
    lens: np.ndarray = np.maximum(np.repeat(rope_lens, num_new), positions + 1)
    return lens  # [num_tokens]


class RequestRotary(nn.Module):
    """Stands in for a model's rotary embedding: cos/sin per token from its rope length.

    The step's rope lengths are set with `for_step` around the model call (the model's
    forward passes only positions to its rotary module). Outside a step it is the module it
    wraps. Each group of tokens with the same frequencies goes through the wrapped module's
    own forward (without transformers' length update), with the frequencies HF's update
    would have set, so the cos/sin layout and attention scaling stay the model's.
    """

    def __init__(self, inner: nn.Module, policy: RopePolicy) -> None:
        super().__init__()
        self.inner: Any = inner  # transformers' rotary module (its buffers read by name)
        self.policy = policy
        self.rope_lens: torch.Tensor | None = None  # [num_tokens] during a step, else None
        # The decorated forward's innermost function: cos/sin from the current inv_freq.
        self._plain_forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] = inspect.unwrap(
            type(inner).forward
        )
        self._frequencies: dict[int, tuple[torch.Tensor, float]] = {}

    def for_step(self, rope_lens: torch.Tensor | None) -> RequestRotary:
        """Set (or clear, with None) the rope lengths of the next forward's tokens."""
        self.rope_lens = rope_lens
        return self

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[1, num_tokens, rotary_dim]` for the flat step's positions."""
        if self.rope_lens is None:
            return self.inner(x, position_ids)  # type: ignore[no-any-return]
        keys = self.policy.frequency_keys(self.rope_lens)
        distinct = torch.unique(keys).tolist()
        if len(distinct) == 1:
            return self._cos_sin(x, position_ids, int(distinct[0]))
        cos_parts, sin_parts, rows = [], [], []
        for key in distinct:
            index = (keys == key).nonzero().flatten()
            cos, sin = self._cos_sin(x, position_ids[:, index], int(key))
            cos_parts.append(cos)
            sin_parts.append(sin)
            rows.append(index)
        order = torch.argsort(torch.cat(rows))
        return torch.cat(cos_parts, 1)[:, order], torch.cat(sin_parts, 1)[:, order]

    def _cos_sin(
        self, x: torch.Tensor, position_ids: torch.Tensor, key: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inner = self.inner
        inv_freq, scaling = self._frequencies_of(key, x.device)
        saved = inner.inv_freq, inner.attention_scaling
        inner.inv_freq, inner.attention_scaling = inv_freq, scaling
        try:
            return self._plain_forward(inner, x, position_ids)
        finally:
            inner.inv_freq, inner.attention_scaling = saved

    def _frequencies_of(self, key: int, device: torch.device) -> tuple[torch.Tensor, float]:
        """(inv_freq, attention scaling) of a frequency key, computed once."""
        found = self._frequencies.get(key)
        if found is None:
            if len(self._frequencies) >= 4096:  # dynamic: one entry per decode length seen
                self._frequencies.clear()
            found = self._frequencies[key] = self._compute(key, device)
        return found

    def _compute(self, key: int, device: torch.device) -> tuple[torch.Tensor, float]:
        """As transformers' `dynamic_rope_update` sets them for a forward of rope length
        `key` (0: the original frequencies)."""
        inner = self.inner
        if key == 0:
            return inner.original_inv_freq.to(device), float(inner.attention_scaling)
        if self.policy.rope_type == "longrope":
            init = ROPE_INIT_FUNCTIONS["longrope"]
            inv_freq, _ = init(inner.config, device, seq_len=self.policy.threshold + 1)
            # HF copies it into the inv_freq buffer (its dtype) and keeps the init scaling.
            return inv_freq.to(inner.inv_freq.dtype), float(inner.attention_scaling)
        # HF passes max(position_ids) + 1, an int64 tensor: the same arithmetic.
        seq_len = torch.tensor(key, dtype=torch.int64, device=device)
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[inner.rope_type](
            inner.config, device, seq_len=seq_len
        )
        return inv_freq, float(scaling)
