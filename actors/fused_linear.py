"""Sibling projections of one input as one packed oneDNN matmul: q/k/v.

A decoder layer computes q, k and v from the same hidden states by separate `nn.Linear`
calls; vLLM runs them as one matmul of the concatenated weights and splits the result. One
wider matmul keeps the CPU's cores busy where three narrow ones (SmolLM2: 576 -> 576, 192,
192) leave them idle between calls and on partial tiles (measured at the engine's shapes:
docs/benchmarks-peers.md, "fused q/k/v").

Why not a new module per architecture (vLLM's way): transformers' own attention and MLP
forwards stay as they are, for every model family. Each member of a group keeps its place in
its parent and is given a forward that asks the group for its part of the output: the first
member called on an input runs the group's matmul (all members' outputs at once, as views of
one tensor) and the others, called next on that same tensor, take their parts. A member
called on another input (or twice) runs the group's matmul again: always correct, only
slower. Groups are sibling linears under known names (`GROUPS`) with the same input width,
dtype and bias presence; anything else stays a single packed linear (actors/cpu_linear.py).

Memory: the group's packed weight replaces its members' packed copies (the model's own
parameters stay untouched, as with `cpu_linear`): two copies of the weights, not three.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Names of sibling linears that transformers' decoders call on one input, in model order.
# q/k/v only: fused they ran 1.36x (32 rows) to 1.02x (512 rows) faster on an AMD EPYC (2
# cores); gate/up fused ran 1.07x at 32 rows but no faster at 175-512 (the engine's decode
# and prefill steps), where SiLU and the product then read strided halves: not fused.
GROUPS = (("q_proj", "k_proj", "v_proj"),)


class FusedProjection:
    """One packed matmul for several sibling linears; hands each member its slice."""

    def __init__(self, linears: list[torch.nn.Linear], batch_hint: int) -> None:
        weight = torch.cat([m.weight.detach() for m in linears])
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        del weight  # the packed copy is the only one kept beside the parameters
        biases = [m.bias for m in linears]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.sizes = [m.out_features for m in linears]
        self._starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.members = len(linears)
        self._input: torch.Tensor | None = None
        self._parts: list[torch.Tensor | None] = []

    def full(self, x: torch.Tensor) -> torch.Tensor:
        """All members' outputs for input `x`, side by side in the last dimension."""
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], ""
        )
        return out

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s output for input `x` (a view into the group's output)."""
        if self._input is not x or self._parts[index] is None:
            out = self.full(x)
            self._parts = [
                out.narrow(-1, a, n) for a, n in zip(self._starts, self.sizes, strict=True)
            ]
            self._input = x
        found = self._parts[index]
        assert found is not None
        self._parts[index] = None
        if not any(p is not None for p in self._parts):  # all served: drop the references
            self._input, self._parts = None, []
        return found


def fusable_groups(model: torch.nn.Module, dtypes: tuple[torch.dtype, ...]) -> list[list[Any]]:
    """The groups of `model` that can run fused: per parent module and `GROUPS` entry, the
    sibling `nn.Linear`s, all present, not packed yet, on CPU in one of `dtypes`, with one
    input width and bias on all or none."""
    found = []
    for parent in model.modules():
        for names in GROUPS:
            found_members = [getattr(parent, name, None) for name in names]
            members = [m for m in found_members if isinstance(m, torch.nn.Linear)]
            if len(members) != len(names):
                continue
            weights = [m.weight for m in members]
            if (
                any(hasattr(m, "_raypack_packed") for m in members)
                or len({w.dtype for w in weights}) != 1
                or weights[0].dtype not in dtypes
                or any(w.device.type != "cpu" for w in weights)
                or len({m.in_features for m in members}) != 1
                or len({m.bias is None for m in members}) != 1
            ):
                continue
            found.append(members)
    return found


def fuse(members: list[torch.nn.Linear], batch_hint: int) -> FusedProjection:
    """Route `members` through one `FusedProjection` (marked packed, as `cpu_linear` marks a
    single layer, so `unpack_linears` undoes it)."""
    group = FusedProjection(members, batch_hint)
    for index, module in enumerate(members):
        module._raypack_packed = group  # type: ignore[assignment]
        module.forward = _member_forward(group, index)  # type: ignore[method-assign,assignment]
    return group


def _member_forward(group: FusedProjection, index: int) -> Callable[[torch.Tensor], Any]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return group.part(index, x)

    return forward
