"""A scheduled step laid out as one flat sequence, shared by the single-device runner
(`ModelRunner.prepare`) and the parallel engine's `plan_step`, so both run the same rows.

Decodes come first (the decode attention backends take them as one batch), then prefill chunks in scheduled
order; positions continue after each request's cached tokens; a request samples (gets a
logits row) when its chunk reaches its last token, unless it is a shared-prefix request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from actors.request import Request
from actors.scheduler import SchedulerOutput
from packing.layout import FlatLayout, flat_layout


@dataclass(frozen=True)
class StepLayout:
    """The step's requests in row order and what the model input needs from them."""

    requests: list[Request]  # in row order: decodes, then prefill chunks
    num_decodes: int
    num_cached: np.ndarray  # tokens already in the cache, per request
    num_new: np.ndarray  # tokens this step computes, per request
    layout: FlatLayout  # positions and cu_seqlens_q of the flat sequence
    input_ids: list[int]
    sampling: list[Request]  # requests that sample, in the order of their logits rows
    logits_rows: list[int]  # each sampling request's last row


def lay_out(sched: SchedulerOutput) -> StepLayout:
    """The flat layout of one scheduled step."""
    decodes = [(r, n) for r, n in sched.scheduled if n == 1 and r.num_computed_tokens > 0]
    others = [(r, n) for r, n in sched.scheduled if not (n == 1 and r.num_computed_tokens)]
    items = decodes + others
    num_cached = np.fromiter((r.num_computed_tokens for r, _ in items), np.int64, len(items))
    num_new = np.fromiter((n for _, n in items), np.int64, len(items))
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
    return StepLayout(
        [r for r, _ in items], len(decodes), num_cached, num_new, layout, ids, sampling, rows
    )
