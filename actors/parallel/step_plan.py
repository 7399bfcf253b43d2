"""A scheduled step as plain arrays: what every worker needs to run it, and nothing more.

`plan_step` lays the step out with `actors.step_layout.lay_out`, as `ModelRunner.prepare` does (one
flat sequence, decodes first, positions continuing after cached tokens, logits only at rows
that sample); the plan is put in Ray's object store once per step and read by all workers,
each of which builds its own `AttentionMetadata` over its own KV tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from actors.request import Request
from actors.rope import token_rope_lens
from actors.scheduler import SchedulerOutput
from actors.step_layout import lay_out
from packing.layout import slot_mapping


@dataclass(frozen=True)
class StepPlan:
    """One step for the workers (no tensors, no requests: cheap to pickle)."""

    step: int  # the executor's step counter (for timings and error messages)
    input_ids: np.ndarray  # [num_tokens]
    positions: np.ndarray  # [num_tokens]
    num_cached: np.ndarray  # [num_reqs]
    num_new: np.ndarray  # [num_reqs]
    block_tables: tuple[tuple[int, ...], ...]  # [num_reqs][num_blocks_i]
    slot_mapping: np.ndarray  # [num_tokens]
    cu_seqlens_q: np.ndarray  # [num_reqs + 1]
    num_decodes: int  # the first num_decodes requests decode one token each
    logits_indices: np.ndarray  # [num_sampling] rows whose logits are needed
    block_copies: tuple[tuple[int, int], ...]  # (src, dst) blocks to copy before the step
    rope_lens: np.ndarray | None = None  # [num_tokens] length-dependent rope only (actors/rope.py)

    @property
    def num_tokens(self) -> int:
        """Rows in the step's flat sequence."""
        return int(self.input_ids.size)


def plan_step(
    sched: SchedulerOutput, block_size: int, step: int, block_offset: int = 0, rope: bool = False
) -> tuple[StepPlan, list[Request]]:
    """The step's plan and the requests that sample, in the order of their logits rows.

    `block_offset` is added to every block id (a virtual engine's slice of the KV tensors);
    `rope`: the model's rope depends on the length, each token's rope length goes along."""
    laid = lay_out(sched)
    rope_lens = None
    if rope:
        lens = np.fromiter((r.rope_len for r in laid.requests), np.int64, len(laid.requests))
        rope_lens = token_rope_lens(lens, laid.num_new, laid.layout.positions)
    tables = tuple(tuple(b + block_offset for b in r.block_ids) for r in laid.requests)
    plan = StepPlan(
        step=step,
        input_ids=np.asarray(laid.input_ids, dtype=np.int64),
        positions=laid.layout.positions,
        num_cached=laid.num_cached,
        num_new=laid.num_new,
        block_tables=tables,
        slot_mapping=slot_mapping(
            laid.num_cached, laid.num_new, [list(t) for t in tables], block_size
        ),
        cu_seqlens_q=laid.layout.cu_seqlens_q,
        num_decodes=laid.num_decodes,
        logits_indices=np.asarray(laid.logits_rows, dtype=np.int64),
        block_copies=tuple((s + block_offset, d + block_offset) for s, d in sched.block_copies),
        rope_lens=rope_lens,
    )
    return plan, laid.sampling
