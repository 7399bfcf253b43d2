"""A scheduled step as plain arrays: what every worker needs to run it, and nothing more.

`plan_step` lays the step out exactly as `actors.model_runner.ModelRunner.prepare` does (one
flat sequence, decodes first, positions continuing after cached tokens, logits only at rows
that sample); the plan is put in Ray's object store once per step and read by all workers,
each of which builds its own `AttentionMetadata` over its own KV tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from actors.request import Request
from actors.scheduler import SchedulerOutput
from packing.layout import flat_layout, slot_mapping


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

    @property
    def num_tokens(self) -> int:
        """Rows in the step's flat sequence."""
        return int(self.input_ids.size)


def plan_step(
    sched: SchedulerOutput, block_size: int, step: int, block_offset: int = 0
) -> tuple[StepPlan, list[Request]]:
    """The step's plan and the requests that sample, in the order of their logits rows.

    `block_offset` is added to every block id (a virtual engine's slice of the KV tensors)."""
    decodes = [(r, n) for r, n in sched.scheduled if n == 1 and r.num_computed_tokens > 0]
    others = [(r, n) for r, n in sched.scheduled if not (n == 1 and r.num_computed_tokens)]
    items = decodes + others
    num_cached = np.fromiter((r.num_computed_tokens for r, _ in items), np.int64, len(items))
    num_new = np.fromiter((n for _, n in items), np.int64, len(items))
    tables = tuple(tuple(b + block_offset for b in r.block_ids) for r, _ in items)
    layout = flat_layout(num_cached, num_new)
    ids: list[int] = []
    sampling: list[Request] = []
    rows: list[int] = []
    for i, (req, n) in enumerate(items):
        start = req.num_computed_tokens
        ids.extend(req.token_ids[start : start + n])
        if not req.is_prefix and start + n == req.num_tokens:
            sampling.append(req)
            rows.append(int(layout.cu_seqlens_q[i + 1]) - 1)
    plan = StepPlan(
        step=step,
        input_ids=np.asarray(ids, dtype=np.int64),
        positions=layout.positions,
        num_cached=num_cached,
        num_new=num_new,
        block_tables=tables,
        slot_mapping=slot_mapping(num_cached, num_new, [list(t) for t in tables], block_size),
        cu_seqlens_q=layout.cu_seqlens_q,
        num_decodes=len(decodes),
        logits_indices=np.asarray(rows, dtype=np.int64),
        block_copies=tuple((s + block_offset, d + block_offset) for s, d in sched.block_copies),
    )
    return plan, sampling
