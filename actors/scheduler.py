"""Choose each step's `{request: num_new_tokens}` under a token budget and the KV pool.

Decode-maximal batching (Sarathi): running requests that decode go first (one token each),
then running requests still in prefill, then new admissions in the planned order, each chunk
capped by `chunk_size` and by what is left of the step's token budget (`max_num_batched_tokens`,
or what the engine's TPOT controller gives the step: packing/step_budget.py). With a `chunk_size`,
running prefills also leave room for the next admission's first chunk while one waits (at
most half the budget; what it does not use goes back to them), so long prompts in prefill,
however many, never hold a newcomer back: it starts in the next step. Admission is by KV
blocks (BatchLLM's memory-centric batching); `max_num_seqs` is only a cap. When a running
request cannot grow, the newest running request is preempted: its blocks are freed and it is
recomputed later (its full blocks usually come back from the prefix cache).

Prefix groups: the group's internal prefix request is admitted like any other; its members
wait until it is fully computed, then take references to its full blocks and get a copy of its
trailing partial block (copy-on-write), so the prefix is computed exactly once. Groups nest:
a nested group's prefix request is a member of its parent group in the same way, and is
released (its blocks dropped) when its own last member finishes.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from actors.config import EngineConfig
from actors.kv_cache import KVCacheManager
from actors.outputs import FinishReason
from actors.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    """One step's plan for the model runner."""

    scheduled: list[tuple[Request, int]]  # (request, num_new_tokens): decodes, then prefills
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks
    preempted: list[Request] = field(default_factory=list)
    token_budget: int = 0  # the step's budget (fixed, or the TPOT controller's)
    num_decodes: int = 0  # running requests that decode in it

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """`{request_id: num_new_tokens}`."""
        return {req.request_id: n for req, n in self.scheduled}

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens in the step's flat sequence."""
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """Waiting and running queues, and the step plan over them."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the newest is last
        self.prefix_holders: list[Request] = []  # computed group prefixes kept for members
        self.num_preemptions = 0
        self.failed: list[Request] = []  # ended by the scheduler itself; the engine reports them
        # Keep a few blocks free at admission so running decodes can grow without preempting.
        self.watermark_blocks = max(1, kv.num_blocks // 100)

    def add(self, request: Request) -> None:
        """Queue a request behind the others (planned order = arrival order)."""
        assert request.status is RequestStatus.WAITING and not request.block_ids, request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        """True while a request is waiting or running."""
        return bool(self.waiting or self.running)

    @property
    def num_decodes(self) -> int:
        """Running requests that decode in the next step (one token each)."""
        return sum(1 for r in self.running if r.num_uncomputed_tokens == 1)

    def schedule(self, token_budget: int | None = None) -> SchedulerOutput:
        """Plan the next step. The token budget (`token_budget`, else the configured
        `max_num_batched_tokens`) is filled decodes first."""
        budget = token_budget or self.config.max_num_batched_tokens
        chunk = self.config.chunk_size or budget
        plan: dict[str, tuple[Request, int]] = {}
        out = SchedulerOutput(scheduled=[], token_budget=budget)

        decoding = [r for r in self.running if r.num_uncomputed_tokens == 1]
        prefilling = [r for r in self.running if r.num_uncomputed_tokens > 1]
        reserve = self._admission_reserve(chunk, budget) if prefilling else 0
        out.num_decodes = len(decoding)
        held_back: list[Request] = []  # prefills given less than their chunk for the reserve
        for req in decoding + prefilling:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            wanted = min(req.num_uncomputed_tokens, chunk)
            num_new = min(wanted, budget if wanted == 1 else budget - reserve)
            if num_new < min(wanted, budget):
                held_back.append(req)
            if num_new <= 0:
                continue
            while self.kv.allocate(req, req.num_computed_tokens + num_new) is None:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim.request_id in plan:
                    budget += plan.pop(victim.request_id)[1]
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                plan[req.request_id] = (req, num_new)
                budget -= num_new

        # No admissions in a step that had to preempt: memory is already short.
        while not out.preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            candidate = self._next_admissible()
            if candidate is None:
                break
            req = candidate
            assert req.status is RequestStatus.WAITING and not req.block_ids, req.request_id
            shared, num_shared, copy_src = self._computed_prefix(req)
            num_new = min(req.num_tokens - num_shared, chunk, budget)
            fresh = self.kv.allocate(req, num_shared + num_new, shared)
            if fresh is None or (self.running and self.kv.num_free_blocks < self.watermark_blocks):
                if fresh is not None:  # admitted into the watermark: undo
                    self.kv.free(req)
                break
            if copy_src is not None:
                out.block_copies.append((copy_src, fresh[0]))
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_shared
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = min(num_shared, req.num_prompt_tokens)
            self.running.append(req)
            plan[req.request_id] = (req, num_new)
            budget -= num_new

        self._give_back(held_back, plan, budget, chunk)
        out.scheduled = list(plan.values())
        if not out.scheduled and not self.running and self.waiting:
            self._fail_unschedulable()
        return out

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Record the computed tokens of a finished step and publish full blocks."""
        for req, num_new in out.scheduled:
            req.num_computed_tokens += num_new
            self.kv.cache_full_blocks(req)
            if req.is_prefix and req.num_computed_tokens == req.num_tokens:
                self.running.remove(req)
                self.prefix_holders.append(req)

    def finish(self, requests: Iterable[Request], reason: FinishReason) -> None:
        """End requests (any state): free their blocks, release group prefixes."""
        done = [r for r in requests if r.status is not RequestStatus.FINISHED]
        if not done:
            return
        ids = {id(r) for r in done}
        self.running = [r for r in self.running if id(r) not in ids]
        if any(r.status is RequestStatus.WAITING for r in done):
            self.waiting = deque(r for r in self.waiting if id(r) not in ids)
        for req in done:
            self.kv.free(req)
            req.status = RequestStatus.FINISHED
            if req.finish_reason is None:
                req.finish_reason = reason
            group = req.member_of
            if group is not None:
                group.num_unfinished_members -= 1
                if group.num_unfinished_members == 0:
                    self._release_prefix(group.prefix)

    def _release_prefix(self, prefix: Request) -> None:
        if prefix in self.prefix_holders:
            self.prefix_holders.remove(prefix)
        self.finish([prefix], "stop")

    def _give_back(
        self,
        held_back: list[Request],
        plan: dict[str, tuple[Request, int]],
        budget: int,
        chunk: int,
    ) -> None:
        """Give what the admissions left of the reserve back to the prefills held back for it
        (up to their chunk; only from free blocks, never by preempting)."""
        for req in held_back:
            if budget == 0:
                return
            if req.status is not RequestStatus.RUNNING:  # preempted in this step
                continue
            num_new = plan[req.request_id][1] if req.request_id in plan else 0
            extra = min(min(req.num_uncomputed_tokens, chunk) - num_new, budget)
            total = req.num_computed_tokens + num_new + extra
            if extra > 0 and self.kv.allocate(req, total) is not None:
                plan[req.request_id] = (req, num_new + extra)
                budget -= extra

    def _admission_reserve(self, chunk: int, budget: int) -> int:
        """Budget that running prefills leave for the next admission's first chunk: none
        without a `chunk_size` (a prefill may take the whole step), when nothing can be
        admitted (no one waiting, `max_num_seqs` running, or too few free blocks), and at
        most half the budget, so running prefills always progress."""
        if self.config.chunk_size is None or len(self.running) >= self.config.max_num_seqs:
            return 0
        head = self._next_admissible()
        if head is None:
            return 0
        reserve = min(head.num_tokens, chunk, budget // 2)
        if self.kv.num_free_blocks < self.kv.blocks_for(reserve) + self.watermark_blocks:
            return 0
        return reserve

    def _next_admissible(self) -> Request | None:
        for req in self.waiting:
            # A member waits for its group's prefix; requests behind it may go first.
            if req.member_of is not None and not _prefix_ready(req):
                continue
            return req
        return None

    def _computed_prefix(self, req: Request) -> tuple[list[int], int, int | None]:
        """Blocks the request can take by reference, the tokens they cover, and the block
        to copy the trailing partial prefix block from (None: nothing to copy)."""
        cached = self.kv.find_cached_blocks(req)
        num_cached = len(cached) * self.kv.block_size
        group = req.member_of
        if group is not None:
            # Leave one token to compute: the next token is sampled from its logits.
            num_shared = min(group.prefix.num_tokens, req.num_tokens - 1)
            if num_shared > num_cached:
                num_full, partial = divmod(num_shared, self.kv.block_size)
                src = group.prefix.block_ids[num_full] if partial else None
                return group.prefix.block_ids[:num_full], num_shared, src
        return cached, num_cached, None

    def restart(self, req: Request, rope_len: int, cache_salt: int | None) -> None:
        """Recompute a running request from its first token with new rope frequencies
        (phi3's `generate` does so when a sequence first grows past its original context,
        actors/rope.py). It leaves its prefix group: the group's blocks hold the old ones."""
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.rope_len, req.cache_salt, req.block_hashes = rope_len, cache_salt, []
        group = req.member_of
        if group is not None:
            req.group = None
            group.num_unfinished_members -= 1
            if group.num_unfinished_members == 0:
                self._release_prefix(group.prefix)
        self.waiting.appendleft(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _fail_unschedulable(self) -> None:
        """Nothing runs and the first admissible request does not fit: end it with an error
        instead of looping forever (its prompt needs more blocks than the pool can give)."""
        req = self._next_admissible()
        if req is None:
            return
        req.error = (
            f"request needs {self.kv.blocks_for(req.num_tokens)} KV blocks but only "
            f"{self.kv.num_free_blocks} of {self.kv.num_blocks} can be freed for it"
        )
        self.finish([req], "error")
        self.failed.append(req)


def _prefix_ready(req: Request) -> bool:
    group = req.member_of
    return group is not None and group.ready and bool(group.prefix.block_ids)
