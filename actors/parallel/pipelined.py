"""A pipeline-parallel engine with several steps in flight, so the stages overlap.

vLLM's virtual engines: the requests are split into `pp` disjoint sets, each with its own
scheduler and its own slice of the KV pool. Steps of the sets are submitted in turn, up to
`pp` at once: while stage 1 runs set A's step, stage 0 runs set B's. A set is scheduled
again only after its previous step was sampled, so every step sees its requests' latest
tokens. Equal token budgets (Sarathi: chunked prefill, decodes first) keep consecutive steps
the same size, which is what keeps the stages from waiting on each other; `bubble_fraction`
measures how much they still do.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from actors.config import EngineConfig
from actors.engine import LLMEngine
from actors.kv_cache import KVCacheManager
from actors.outputs import FinishReason, RequestOutput
from actors.parallel.executor import ParallelExecutor, StepHandle
from actors.request import Request
from actors.scheduler import Scheduler, SchedulerOutput


class VirtualSchedulers:
    """`pp` schedulers, each over its own KV pool; routes a request to its set's scheduler.

    A prefix group (its prefix request and all members) stays in one set, so members find
    the prefix's blocks; other requests go to the set with the fewest requests.
    """

    def __init__(self, config: EngineConfig, blocks_per_set: int, count: int) -> None:
        self.kvs = [
            KVCacheManager(blocks_per_set, config.block_size, config.enable_prefix_caching)
            for _ in range(count)
        ]
        self.schedulers = [Scheduler(config, kv) for kv in self.kvs]
        self._owner: dict[str, int] = {}  # request id (or group prefix id) -> set

    def owner(self, request: Request) -> int:
        """The set a queued request belongs to."""
        return self._owner[request.request_id]

    def add(self, request: Request) -> None:
        """Queue a request in its set."""
        # A nested group's tree shares blocks from its root down: all of it in one set.
        group = request.group.root if request.group is not None else None
        group_key = group.prefix.request_id if group is not None else None
        if group_key is not None and group_key in self._owner:
            index = self._owner[group_key]
        else:
            index = min(range(len(self.schedulers)), key=lambda i: self._load(i))
        if group_key is not None:
            self._owner[group_key] = index
        self._owner[request.request_id] = index
        self.schedulers[index].add(request)

    def finish(self, requests: Iterable[Request], reason: FinishReason) -> None:
        """End requests in their sets."""
        requests = list(requests)
        by_set: dict[int, list[Request]] = {}
        for req in requests:
            index = self._owner.pop(req.request_id, None)
            if index is not None:
                by_set.setdefault(index, []).append(req)
        for index, reqs in by_set.items():
            self.schedulers[index].finish(reqs, reason)
        for req in requests:  # a group's prefix ends inside its scheduler with its last member
            group = req.group  # (and a nested group's end may end the groups around it)
            while group is not None and group.num_unfinished_members == 0:
                self._owner.pop(group.prefix.request_id, None)
                group = group.parent

    def _load(self, index: int) -> int:
        scheduler = self.schedulers[index]
        return len(scheduler.waiting) + len(scheduler.running)

    # what the engine's summary log reads
    @property
    def running(self) -> list[Request]:
        """Running requests of all sets."""
        return [r for s in self.schedulers for r in s.running]

    @property
    def waiting(self) -> list[Request]:
        """Waiting requests of all sets."""
        return [r for s in self.schedulers for r in s.waiting]

    @property
    def num_preemptions(self) -> int:
        """Preemptions in all sets."""
        return sum(s.num_preemptions for s in self.schedulers)

    @property
    def failed(self) -> list[Request]:
        """Requests the schedulers ended themselves (read by the step, then cleared)."""
        return [r for s in self.schedulers for r in s.failed]


class PipelinedEngine(LLMEngine):
    """`LLMEngine` with `pp` virtual engines in flight (chosen by `LLMEngine` when pp > 1)."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        assert isinstance(self.runner, ParallelExecutor)
        self.executor: ParallelExecutor = self.runner
        pp = self.config.pipeline_parallel_size
        self.blocks_per_set = self.kv.num_blocks // pp
        if self.blocks_per_set < 1:
            raise ValueError(f"{self.kv.num_blocks} KV blocks cannot be split into {pp} sets")
        self.sets = VirtualSchedulers(self.config, self.blocks_per_set, pp)
        self.scheduler = self.sets  # type: ignore[assignment]  # add/finish route by set
        self.kv = self.sets.kvs[0]
        self.max_model_len = min(self.max_model_len, self.blocks_per_set * self.config.block_size)
        self._in_flight: deque[tuple[int, SchedulerOutput, StepHandle]] = deque()
        self._next_set = 0

    def step(self) -> list[RequestOutput]:
        """Fill the pipeline (one step per idle set with work), then finish the oldest step.
        Returns the outputs of that step."""
        outputs, self._pending = self._pending, []
        self._fill(outputs)
        if not self._in_flight:
            return outputs
        index, sched, handle = self._in_flight.popleft()
        started = time.perf_counter()
        sampling, logits = self.executor.collect(handle)
        scheduler = self.sets.schedulers[index]
        scheduler.update_after_step(sched)
        sampled = self.sampler(logits, sampling)
        finished: dict[FinishReason, list[Request]] = {}
        for req, token_id, logprob in zip(
            sampling, sampled.token_ids, sampled.logprobs, strict=True
        ):
            if req.finished:  # aborted while its step was in flight
                continue
            reason = self._append(req, token_id, logprob)
            if reason is not None:
                finished.setdefault(reason, []).append(req)
            else:
                outputs.append(self._output(req))
        for reason, reqs in finished.items():
            self.sets.finish(reqs, reason)
            outputs.extend(self._retire(req) for req in reqs)
        self._stats.record(self, sched, time.perf_counter() - started)
        self._fill(outputs)  # the set just sampled can go again before we wait
        return outputs

    def _fill(self, outputs: list[RequestOutput]) -> None:
        pp = len(self.sets.schedulers)
        busy = {index for index, _, _ in self._in_flight}
        for offset in range(pp):
            if len(self._in_flight) >= pp:
                return
            index = (self._next_set + offset) % pp
            scheduler = self.sets.schedulers[index]
            if index in busy or not scheduler.has_unfinished():
                continue
            sched = scheduler.schedule()
            for req in scheduler.failed:
                self.sets._owner.pop(req.request_id, None)
                outputs.append(self._retire(req))
            scheduler.failed.clear()
            if not sched.scheduled:
                continue
            handle = self.executor.submit(sched, index * self.blocks_per_set)
            self._in_flight.append((index, sched, handle))
            busy.add(index)
            self._next_set = (index + 1) % pp

    def has_unfinished(self) -> bool:
        """True while a request is queued, running or in flight."""
        return bool(self._in_flight) or super().has_unfinished()


def bubble_fraction(timings: list[list[tuple[int, float, float]]]) -> float:
    """Idle share of the stages between the first step's start and the last step's end:
    `1 - busy / (stages * span)` from each stage's (step, start, end) records."""
    spans = [(start, end) for stage in timings for _, start, end in stage]
    if not spans:
        return 0.0
    span = max(e for _, e in spans) - min(s for s, _ in spans)
    busy = sum(e - s for s, e in spans)
    return max(0.0, 1.0 - busy / (len(timings) * span)) if span > 0 else 0.0
