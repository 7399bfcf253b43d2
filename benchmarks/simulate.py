"""A noise-free model of the staging queue + engine, driven by the real admission rule.

Live benchmarks on a shared 2-core CPU are noisy; this replays the same requests through the
same `AdmissionController` against a modelled engine that schedules like ours (each step one
token budget: running decodes first, then prefill chunks first-come first-served; the first
token is sampled when a prompt's prefill completes) with a linear step cost. It isolates what
the policy itself does to TTFT.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from benchmarks.replay import Result, TraceRequest
from packing.admission import AdmissionConfig, AdmissionController
from packing.step_budget import StepBudgetConfig, StepBudgetController


@dataclass(frozen=True)
class StepCost:
    """Seconds per engine step: fixed + per scheduled token + per scheduled request."""

    fixed_s: float = 0.05
    per_token_s: float = 0.0013
    per_request_s: float = 0.002

    def __call__(self, tokens: int, requests: int) -> float:
        """The duration of a step with `tokens` tokens from `requests` requests."""
        return self.fixed_s + self.per_token_s * tokens + self.per_request_s * requests


@dataclass
class _Req:
    index: int
    arrival: float
    prefill_left: int
    decode_left: int
    first_token: float | None = None


def simulate(
    requests: list[TraceRequest],
    admission: AdmissionConfig,
    cost: StepCost,
    *,
    token_budget: int = 512,
    max_running: int = 256,
    step_budget: StepBudgetConfig | None = None,
) -> list[Result]:
    """Every request's TTFT and latency under `admission` in the modelled engine (each step's
    budget `token_budget`, or set by the TPOT controller `step_budget`)."""
    controller = AdmissionController(admission)
    budgeter = StepBudgetController(step_budget) if step_budget is not None else None
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    pending = deque(order)
    staging: deque[_Req] = deque()
    waiting: deque[_Req] = deque()  # admitted, prefill not finished (FCFS)
    running: list[_Req] = []  # decoding
    done: dict[int, tuple[_Req, float]] = {}
    now = 0.0
    while pending or staging or waiting or running:
        while pending and requests[pending[0]].arrival_s <= now:
            i = pending.popleft()
            r = requests[i]
            staging.append(_Req(i, r.arrival_s, len(r.prompt_token_ids), r.max_tokens - 1))
            controller.observe_arrival(r.arrival_s)
        oldest = staging[0].arrival if staging else None
        decision = controller.decide(now, len(staging), oldest)
        room = max(0, max_running - len(waiting) - len(running))
        for _ in range(min(decision.count, room)):
            waiting.append(staging.popleft())
        if not waiting and not running:  # idle: jump to the next event
            next_times = [requests[pending[0]].arrival_s] if pending else []
            if decision.wake_at is not None:
                next_times.append(decision.wake_at)
            if not next_times:
                break
            now = max(now, min(next_times))
            continue
        budget = token_budget if budgeter is None else budgeter.budget(len(running))
        given = budget
        decodes = running[:budget]
        budget -= len(decodes)
        chunks: list[tuple[_Req, int]] = []
        for req in waiting:
            if budget <= 0:
                break
            take = min(req.prefill_left, budget)
            chunks.append((req, take))
            budget -= take
        tokens = len(decodes) + sum(n for _, n in chunks)
        step_s = cost(tokens, len(decodes) + len(chunks))
        now += step_s
        if budgeter is not None:
            budgeter.observe(step_s, given, tokens, len(decodes))
        ttfts = []
        for req in decodes:
            req.decode_left -= 1
        for req, take in chunks:
            req.prefill_left -= take
            if req.prefill_left == 0:
                waiting.remove(req)
                req.first_token = now
                ttfts.append(now - req.arrival)
                running.append(req)
        for req in [r for r in running if r.decode_left <= 0]:
            running.remove(req)
            done[req.index] = (req, now)
        controller.observe_ttfts(ttfts)
    results = []
    for i, request in enumerate(requests):
        req, finished = done[i]
        assert req.first_token is not None
        results.append(
            Result(
                arrival_s=request.arrival_s,
                phase=request.phase,
                status=200,
                ttft_s=req.first_token - req.arrival,
                latency_s=finished - req.arrival,
                output_tokens=request.max_tokens,
                finished_at_s=finished,
            )
        )
    return results
