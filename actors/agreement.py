"""How closely an engine in lower precision follows the float32 engine: teacher-forced
agreement, a figure users can read before choosing `dtype="bfloat16"`.

The reference (float32) engine's greedy continuations are the targets. Each engine is then
fed those same tokens (teacher forcing: whatever it would have picked, the target token is
appended), so both are scored at the same contexts and one early difference does not make
every later position incomparable. At every generated position we keep the engine's own
top-1 token and the log-probability it gives the target token. Two figures follow:

- top-1 agreement: the fraction of positions where the engine's argmax is the target token
  (the float32 engine against its own targets: 1, up to exact ties);
- mean |delta logprob|: the mean absolute difference of the target token's log-probability
  between the engine and the reference, in nats.

Forcing runs through the engine itself (`LLMEngine`, its batching, paged KV cache and
attention backend): its executor is wrapped for the call, and each sampling row's logits are
read, then replaced by a row whose only finite entry is the target token, so the sampler (any
parameters) appends the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from actors.config import SamplingParams
from actors.request import Request
from actors.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from actors.engine import LLMEngine
    from actors.model_runner import StepRunner


@dataclass(frozen=True)
class Forced:
    """Per prompt, per generated position: the engine's top-1 token and the log-probability
    it gives the target token."""

    top1: list[list[int]]
    logprobs: list[list[float]]


class _ForcingRunner:
    """An engine's executor with every sampling row's logits recorded, then forced to the
    request's next target token."""

    def __init__(self, inner: StepRunner, targets: dict[str, list[int]]) -> None:
        self.inner = inner
        self.max_in_flight = inner.max_in_flight
        self.targets = targets
        # request id -> position -> (top1, logprob of the target); a position computed again
        # after a preemption overwrites its entry
        self.seen: dict[str, dict[int, tuple[int, float]]] = {r: {} for r in targets}

    def submit(self, sched: SchedulerOutput, block_offset: int = 0) -> Any:
        return self.inner.submit(sched, block_offset)

    def collect(self, handle: Any) -> tuple[list[Request], torch.Tensor]:
        sampling, logits = self.inner.collect(handle)
        assert isinstance(logits, torch.Tensor), "teacher forcing turns the screened head off"
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top1 = logprobs.argmax(dim=-1).tolist()
        forced = torch.full_like(logprobs, float("-inf"))  # (the logits are inference tensors)
        for row, req in enumerate(sampling):
            target = self.targets[req.request_id]
            position = len(req.token_ids) - req.num_prompt_tokens
            token = target[position]
            self.seen[req.request_id][position] = (top1[row], float(logprobs[row, token]))
            forced[row, token] = 0.0
        return sampling, forced

    def shutdown(self) -> None:
        self.inner.shutdown()


def greedy_targets(
    engine: LLMEngine, prompts: Sequence[Sequence[int]], max_tokens: int
) -> list[list[int]]:
    """The engine's greedy continuations (up to `max_tokens`, EOS included when reached)."""
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    return [list(o.token_ids) for o in outs]


def teacher_forced(
    engine: LLMEngine, prompts: Sequence[Sequence[int]], targets: Sequence[Sequence[int]]
) -> Forced:
    """Feed each prompt's `targets` through `engine` (one request per prompt, all at once, as
    `generate` does); the engine must have no unfinished requests."""
    if engine.has_unfinished():
        raise ValueError("teacher forcing needs an idle engine")
    if any(not t for t in targets) or len(targets) != len(prompts):
        raise ValueError("one non-empty target sequence per prompt is needed")
    params = [SamplingParams(max_tokens=len(t), ignore_eos=True) for t in targets]
    inner = engine.runner
    ids = engine.add_prompts(prompts, params)
    forcing = _ForcingRunner(inner, {i: list(t) for i, t in zip(ids, targets, strict=True)})
    engine.runner = forcing
    # the forcing reads full logits: no greedy shortcut meanwhile (the screened head,
    # actors/screened_head.py; the bfloat16 argmax, actors/kernels/fused.py)
    shortcuts = {
        name: value
        for name in ("screened_head", "greedy_argmax")
        if (value := getattr(inner, name, None)) is not None
    }
    for name in shortcuts:
        setattr(inner, name, None)
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.runner = inner
        for name, value in shortcuts.items():
            setattr(inner, name, value)
    top1, logprobs = [], []
    for i, target in zip(ids, targets, strict=True):
        seen = forcing.seen[i]
        if len(seen) != len(target):
            raise RuntimeError(f"request {i} ended after {len(seen)} of {len(target)} tokens")
        top1.append([seen[p][0] for p in range(len(target))])
        logprobs.append([seen[p][1] for p in range(len(target))])
    return Forced(top1, logprobs)


def agreement(
    reference: Forced, other: Forced, targets: Sequence[Sequence[int]]
) -> dict[str, float | int]:
    """`other`'s agreement with `reference` on the same targets: top-1 agreement (positions,
    and first tokens), |delta logprob| (mean, median, p99, max), and the reference's own
    top-1 agreement with its targets (1 up to ties; a check that the targets are its own)."""
    target = np.concatenate([np.asarray(t) for t in targets])
    mine = np.concatenate([np.asarray(t) for t in other.top1])
    theirs = np.concatenate([np.asarray(t) for t in reference.top1])
    delta = np.abs(
        np.concatenate([np.asarray(x) for x in other.logprobs])
        - np.concatenate([np.asarray(x) for x in reference.logprobs])
    )
    first = [o[0] == t[0] for o, t in zip(other.top1, targets, strict=True)]
    return {
        "sequences": len(targets),
        "positions": int(len(target)),
        "top1_agreement": float(np.mean(mine == target)),
        "first_token_agreement": float(np.mean(first)),
        "mean_abs_logprob_diff": float(delta.mean()),
        "median_abs_logprob_diff": float(np.median(delta)),
        "p99_abs_logprob_diff": float(np.quantile(delta, 0.99)),
        "max_abs_logprob_diff": float(delta.max()),
        "reference_top1_agreement": float(np.mean(theirs == target)),
    }
