"""Pipeline stages of a Hugging Face decoder: embedding on the first stage, a contiguous slice
of decoder layers on each, final norm and LM head on the last.

`StageModel.forward` is the decoder's own forward cut into pieces (embed -> rotary -> layers ->
norm -> LM head at the sampling rows); every stage computes the rotary embeddings for the
step's positions itself, so only the hidden states travel between stages.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from actors import attention
from actors.rope import RequestRotary


def layer_range(num_layers: int, num_stages: int, stage: int) -> tuple[int, int]:
    """Layers `[start, stop)` of `stage`: as even as possible, earlier stages one more."""
    if num_stages > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={num_stages} exceeds the model's {num_layers} layers"
        )
    per, extra = divmod(num_layers, num_stages)
    start = stage * per + min(stage, extra)
    return start, start + per + (1 if stage < extra else 0)


class StageModel(nn.Module):
    """One worker's part of the model: optional embedding, some layers, optional head."""

    def __init__(
        self,
        layers: list[nn.Module],
        rotary: nn.Module,
        embed: nn.Module | None = None,
        norm: nn.Module | None = None,
        lm_head: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.rotary = rotary
        self.embed = embed
        self.norm = norm
        self.lm_head = lm_head

    @property
    def is_first(self) -> bool:
        """Takes token ids (owns the embedding)."""
        return self.embed is not None

    @property
    def is_last(self) -> bool:
        """Returns logits (owns the norm and LM head)."""
        return self.lm_head is not None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [1, num_tokens]
        position_ids: torch.Tensor,  # [1, num_tokens]
        hidden: torch.Tensor | None,  # [1, num_tokens, hidden] from the previous stage
        logits_indices: torch.Tensor,  # [num_sampling]
        meta: attention.AttentionMetadata,
        rope_lens: torch.Tensor | None = None,  # [num_tokens] length-dependent rope only
    ) -> torch.Tensor:
        """Hidden states `[1, num_tokens, hidden]`, or float32 logits `[num_sampling, vocab]`
        on the last stage."""
        if self.embed is not None:
            hidden = self.embed(input_ids)
        assert hidden is not None, "a stage without the embedding needs the previous hidden"
        if isinstance(self.rotary, RequestRotary):
            cos_sin = self.rotary.for_step(rope_lens)(hidden, position_ids)
            self.rotary.for_step(None)
        else:
            cos_sin = self.rotary(hidden, position_ids)
        kwargs: dict[str, Any] = {attention.ATTN_KWARG: meta}
        for layer in self.layers:
            hidden = layer(
                hidden,
                attention_mask=None,
                position_ids=position_ids,
                position_embeddings=cos_sin,
                **kwargs,
            )
            if isinstance(hidden, tuple):  # older decoder layers return (hidden, ...)
                hidden = hidden[0]
        if self.lm_head is None:
            return hidden
        assert self.norm is not None
        hidden = self.norm(hidden)
        logits: torch.Tensor = self.lm_head(hidden[0, logits_indices]).float()
        return logits
