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

import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from actors.config import EngineConfig
from actors.engine import LLMEngine
from actors.kv_cache import KVCacheManager
from actors.outputs import FinishReason, RequestOutput
from actors.parallel.compiled import CompiledSteps
from actors.parallel.executor import ParallelExecutor
from actors.request import Request
from actors.scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)


class VirtualSchedulers:
    """`pp` schedulers, each over its own KV pool; routes a request to its set's scheduler.

    A prefix group (its prefix request and all members) stays in one set, so members find
    the prefix's blocks; other requests go to the set with the fewest tokens still owed (the
    prompt plus `max_tokens` of its unfinished requests): with prompts of mixed lengths,
    balancing request counts leaves one set with most of the work and the pipeline's tail
    runs one step at a time.
    """

    def __init__(self, config: EngineConfig, blocks_per_set: int, count: int) -> None:
        self.kvs = [
            KVCacheManager(blocks_per_set, config.block_size, config.enable_prefix_caching)
            for _ in range(count)
        ]
        self.schedulers = [Scheduler(config, kv) for kv in self.kvs]
        self._owner: dict[str, int] = {}  # request id (or group prefix id) -> set
        self._owed = [0] * count  # tokens of each set's unfinished requests
        self._weight: dict[str, int] = {}  # request id -> its tokens in _owed

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
            index = min(range(len(self.schedulers)), key=self._owed.__getitem__)
        if group_key is not None:
            self._owner[group_key] = index
        self._owner[request.request_id] = index
        weight = request.num_prompt_tokens + (0 if request.is_prefix else request.params.max_tokens)
        self._weight[request.request_id] = weight
        self._owed[index] += weight
        self.schedulers[index].add(request)

    def release(self, request_id: str) -> None:
        """Forget a request that left its set (finished, failed or a group's ended prefix)."""
        index = self._owner.pop(request_id, None)
        if index is not None:
            self._owed[index] -= self._weight.pop(request_id, 0)

    def finish(self, requests: Iterable[Request], reason: FinishReason) -> None:
        """End requests in their sets."""
        requests = list(requests)
        by_set: dict[int, list[Request]] = {}
        for req in requests:
            index = self._owner.get(req.request_id)
            self.release(req.request_id)
            if index is not None:
                by_set.setdefault(index, []).append(req)
        for index, reqs in by_set.items():
            self.schedulers[index].finish(reqs, reason)
        for req in requests:  # a group's prefix ends inside its scheduler with its last member
            group = req.group  # (and a nested group's end may end the groups around it)
            while group is not None and group.num_unfinished_members == 0:
                self.release(group.prefix.request_id)
                group = group.parent

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
    """`LLMEngine` with `pp` virtual engines in flight (chosen by `LLMEngine` when pp > 1).

    Steps go through the executor's Ray tasks, or (GPU workers on the engine's node, or asked
    for) through a Ray compiled graph over its workers (`actors.parallel.compiled`), which
    then stands in as the engine's runner."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        compiled_graph: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """`compiled_graph`: True runs steps through a Ray compiled graph, False through one
        Ray task per worker per step (the executor's classic path), None (the default): the
        graph when every worker is a GPU on the engine's node. The graph's channel readers
        poll (the driver burned 80% of a core waiting for a result, an idle worker 25%): a
        host core per GPU affords that; a CPU engine pays with the cores its stages compute
        on (benchmarks/bench_parallel.py, SmolLM2 pp=2 on 2 cores: 30% slower per step with
        4-token decode steps, 6% faster with 128-token steps)."""
        super().__init__(config, **kwargs)
        assert isinstance(self.runner, ParallelExecutor)
        executor = self.runner
        pp = self.config.pipeline_parallel_size
        self.executor: CompiledSteps | ParallelExecutor = executor
        try:
            where = _worker_places(executor)
            if compiled_graph is None:
                compiled_graph = where == {"this node cuda"}
            if compiled_graph and any(w.startswith("other node") for w in where):
                # Shared-memory channels are what we measured; across (simulated) nodes the
                # graph's channel reads timed out in our two-node test: keep Ray tasks there.
                logger.info("pp workers span several nodes: one Ray task per worker per step")
                compiled_graph = False
            if compiled_graph:
                self.executor = CompiledSteps(executor, max_in_flight=pp)
                self.runner = self.executor  # type: ignore[assignment]  # the executor's stand-in
        except Exception:
            executor.shutdown()
            raise
        self.blocks_per_set = self.kv.num_blocks // pp
        if self.blocks_per_set < 1:
            raise ValueError(f"{self.kv.num_blocks} KV blocks cannot be split into {pp} sets")
        self.sets = VirtualSchedulers(self.config, self.blocks_per_set, pp)
        self.scheduler = self.sets  # type: ignore[assignment]  # add/finish route by set
        self.kv = self.sets.kvs[0]
        self.max_model_len = min(self.max_model_len, self.blocks_per_set * self.config.block_size)
        self._in_flight: deque[tuple[int, SchedulerOutput, Any]] = deque()  # step handles
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
        self._apply_samples(sampling, logits, self.sets.finish, outputs)
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
                self.sets.release(req.request_id)
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


def _worker_places(executor: ParallelExecutor) -> set[str]:
    """Where the workers are: "this node cuda", "other node cpu", ..."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    workers = executor.all_workers
    nodes = ray.get([w.node_id.remote() for w in workers], timeout=60)
    devices = ray.get([w.device_type.remote() for w in workers], timeout=60)
    return {
        f"{'this' if node == here else 'other'} node {device}"
        for node, device in zip(nodes, devices, strict=True)
    }


def bubble_fraction(timings: list[list[tuple[int, float, float]]]) -> float:
    """Idle share of the stages between the first step's start and the last step's end:
    `1 - busy / (stages * span)` from each stage's (step, start, end) records."""
    spans = [(start, end) for stage in timings for _, start, end in stage]
    if not spans:
        return 0.0
    span = max(e for _, e in spans) - min(s for s, _ in spans)
    busy = sum(e - s for s, e in spans)
    return max(0.0, 1.0 - busy / (len(timings) * span)) if span > 0 else 0.0
