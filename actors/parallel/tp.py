"""Tensor parallelism for Hugging Face decoders (Megatron-style, one all-reduce per block).

q/k/v and gate/up are column-parallel: each rank keeps its heads' (or columns') output rows,
so attention and the activation run on local heads with no communication. o and down are
row-parallel: each rank multiplies its slice of the input features and an all-reduce sums the
partial outputs (the bias, if any, is added once after the sum). When tp exceeds the KV heads
each KV head is replicated on the tp / num_kv_heads ranks whose query heads use it (GQA).
Embedding, norms and LM head stay whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


@dataclass(frozen=True)
class TPShape:
    """How one rank's share of a decoder layer looks."""

    rank: int
    size: int
    num_heads: int  # the model's
    num_kv_heads: int
    head_dim: int
    intermediate_size: int

    @property
    def local_heads(self) -> int:
        """Query heads on this rank."""
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        """KV heads on this rank (1 when replicated)."""
        return max(1, self.num_kv_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        """The first KV head this rank holds."""
        if self.size <= self.num_kv_heads:
            return self.rank * self.local_kv_heads
        return self.rank * self.num_kv_heads // self.size

    def rows(self, name: str) -> tuple[int, int]:
        """Output rows (column-parallel) or input columns (row-parallel) this rank keeps of
        the linear `name` (q_proj, ..., down_proj)."""
        d = self.head_dim
        if name in ("q_proj", "o_proj"):
            return self.rank * self.local_heads * d, (self.rank + 1) * self.local_heads * d
        if name in ("k_proj", "v_proj"):
            return self.first_kv_head * d, (self.first_kv_head + self.local_kv_heads) * d
        per = self.intermediate_size // self.size
        return self.rank * per, (self.rank + 1) * per


def tp_shape(text_config: Any, rank: int, size: int) -> TPShape:
    """This rank's shape; a `ValueError` naming the model's sizes when tp cannot divide them."""
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    inter = text_config.intermediate_size
    problems = []
    if heads % size:
        problems.append(f"{heads} attention heads are not divisible by {size}")
    if size <= kv_heads and kv_heads % size:
        problems.append(f"{kv_heads} KV heads are not divisible by {size}")
    if size > kv_heads and size % kv_heads:
        problems.append(f"{size} is not a multiple of the {kv_heads} KV heads (to replicate them)")
    if inter % size:
        problems.append(f"intermediate_size {inter} is not divisible by {size}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size={size} does not fit this model: " + "; ".join(problems)
        )
    return TPShape(rank, size, heads, kv_heads, head_dim, inter)


class RowParallelLinear(nn.Module):
    """`y = all_reduce(x_local @ W_local^T) + b`: this rank's slice of the input features."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: Any = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The full output, identical on every rank."""
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        if self.bias is not None:
            out = out + self.bias
        return out


def shard_layer(layer: nn.Module, shape: TPShape, group: Any = None) -> None:
    """Replace a decoder layer's attention and MLP linears by this rank's shards (in place,
    same parameter names, uninitialised: the loader fills them from the checkpoint)."""
    for parent in (layer.self_attn, layer.mlp):
        for name in COLUMN + ROW:
            old = getattr(parent, name, None)
            if old is None:
                continue
            if not isinstance(old, nn.Linear):
                raise ValueError(f"cannot shard {type(old).__name__} {name}: expected nn.Linear")
            start, stop = shape.rows(name)
            bias = old.bias is not None
            with torch.device(old.weight.device):
                new: nn.Module
                if name in COLUMN:
                    new = nn.Linear(
                        old.in_features, stop - start, bias=bias, dtype=old.weight.dtype
                    )
                else:
                    new = RowParallelLinear(stop - start, old.out_features, bias, group)
                    new.to(old.weight.dtype)
            setattr(parent, name, new)


def shard_slice(name: str, shape: TPShape) -> tuple[int, int, int] | None:
    """(dim, start, stop) of the checkpoint tensor `name` this rank loads, None: all of it."""
    parts = name.split(".")
    if len(parts) < 2 or parts[-2] not in COLUMN + ROW:
        return None
    module, kind = parts[-2], parts[-1]
    start, stop = shape.rows(module)
    if module in COLUMN:
        return 0, start, stop  # weight rows and bias entries
    if kind == "weight":
        return 1, start, stop  # input columns of a row-parallel weight
    return None  # a row-parallel bias is whole (added once after the all-reduce)
