"""The engine's request sets: `count` schedulers, each over its own slice of the KV pool.

One set for a single-process or tensor-parallel engine; `pp` sets for a pipeline-parallel one
(vLLM's virtual engines), so `pp` steps can be in flight at once, one per set, and every step
still sees its requests' latest tokens. The engine adds, finishes and counts requests through
this router; it schedules and updates each set's `Scheduler` itself.
"""

from __future__ import annotations

from collections.abc import Iterable

from actors.config import EngineConfig
from actors.kv_cache import KVCacheManager
from actors.outputs import FinishReason
from actors.request import Request
from actors.scheduler import Scheduler


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
    def prefix_holders(self) -> list[Request]:
        """Computed group prefixes kept for their members, in all sets."""
        return [r for s in self.schedulers for r in s.prefix_holders]

    @property
    def kv_usage(self) -> float:
        """Share of the KV blocks in use, over all sets."""
        return sum(kv.usage for kv in self.kvs) / len(self.kvs)

    def reset_prefix_cache(self) -> bool:
        """Forget every set's cached prefix blocks (see `KVCacheManager.reset_prefix_cache`)."""
        if any(kv.num_free_blocks != kv.num_blocks for kv in self.kvs):
            return False
        return all([kv.reset_prefix_cache() for kv in self.kvs])

    @property
    def failed(self) -> list[Request]:
        """Requests the schedulers ended themselves (read by the step, then cleared)."""
        return [r for s in self.schedulers for r in s.failed]
