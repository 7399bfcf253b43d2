"""Scheduler and KV cache manager on the CPU, without a model: plans, budgets, blocks."""

from __future__ import annotations

import pytest

from actors import EngineConfig, SamplingParams
from actors.kv_cache import KVCacheManager
from actors.request import Request, RequestStatus, SharedPrefixState
from actors.scheduler import Scheduler, SchedulerOutput


def make(num_blocks: int = 64, prefix_caching: bool = False, **config) -> Scheduler:
    cfg = EngineConfig(num_kv_blocks=num_blocks, block_size=4, **config)
    return Scheduler(cfg, KVCacheManager(num_blocks, 4, prefix_caching))


def req(rid: str, n: int, start: int = 0) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams())


def run(s: Scheduler) -> SchedulerOutput:
    """Schedule and pretend the step ran; sampling requests get a token."""
    out = s.schedule()
    s.update_after_step(out)
    for r, _ in out.scheduled:
        if not r.is_prefix and r.num_computed_tokens == r.num_tokens:
            r.append_token(7)
    return out


def test_decodes_first_then_chunks_in_order_within_the_budget() -> None:
    s = make(max_num_batched_tokens=10, chunk_size=6)
    a, b, c = req("a", 3), req("b", 9), req("c", 20)
    for r in (a, b, c):
        s.add(r)
    assert run(s).num_scheduled_tokens == {"a": 3, "b": 6, "c": 1}
    # a decodes first; b finishes its prefill; c gets what is left, up to the chunk size.
    assert run(s).num_scheduled_tokens == {"a": 1, "b": 3, "c": 6}
    out = run(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 6}
    assert [r.request_id for r, _ in out.scheduled] == ["a", "b", "c"]
    assert out.total_num_scheduled_tokens == 8


def test_admission_is_by_kv_blocks_and_capped_by_max_num_seqs() -> None:
    s = make(num_blocks=10, max_num_batched_tokens=100)
    for i in range(4):
        s.add(req(f"r{i}", 12, start=100 * i))  # 3 blocks each
    out = run(s)
    assert list(out.num_scheduled_tokens) == ["r0", "r1", "r2"]  # 9 blocks + 1 watermark
    capped = make(max_num_seqs=2)
    for i in range(3):
        capped.add(req(f"r{i}", 4))
    assert list(run(capped).num_scheduled_tokens) == ["r0", "r1"]


def test_preemption_frees_the_newest_and_recomputes_it() -> None:
    s = make(num_blocks=6, max_num_batched_tokens=100)
    old, new = req("old", 8), req("new", 8, start=50)
    s.add(old)
    s.add(new)
    run(s)  # 2 + 2 blocks in use, both have a token
    for _ in range(7):
        out = run(s)
        if out.preempted:
            break
    assert [r.request_id for r in out.preempted] == ["new"]
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0
    assert not new.block_ids and s.num_preemptions == 1
    assert "new" not in out.num_scheduled_tokens and "old" in out.num_scheduled_tokens
    s.finish([old], "stop")
    pending = new.num_tokens
    out = run(s)
    assert out.num_scheduled_tokens == {"new": pending}  # prompt + its tokens, recomputed


def test_prefix_group_members_wait_then_share_blocks_and_copy_the_partial_one() -> None:
    s = make(max_num_batched_tokens=100)
    prefix = Request("p", list(range(10)), SamplingParams(), is_prefix=True)
    group = SharedPrefixState(prefix=prefix, num_unfinished_members=2)
    prefix.group = group
    m1 = Request("m1", list(range(10)) + [50, 51, 52], SamplingParams(), group=group)
    m2 = Request("m2", list(range(10)) + [60], SamplingParams(), group=group)
    other = req("x", 5, start=200)
    for r in (prefix, m1, m2, other):
        s.add(r)
    out = run(s)
    assert out.num_scheduled_tokens == {"p": 10, "x": 5}  # members wait for the prefix
    assert prefix in s.prefix_holders and prefix not in s.running
    out = run(s)
    assert out.num_scheduled_tokens == {"x": 1, "m1": 3, "m2": 1}
    assert m1.block_ids[:2] == prefix.block_ids[:2] == m2.block_ids[:2]
    partial = prefix.block_ids[2]
    assert out.block_copies == [(partial, m1.block_ids[2]), (partial, m2.block_ids[2])]
    assert m1.num_cached_tokens == m2.num_cached_tokens == 10
    s.finish([m1], "stop")
    assert prefix.block_ids  # m2 still needs it
    s.finish([m2], "stop")
    assert prefix.status is RequestStatus.FINISHED and not prefix.block_ids
    s.finish([other], "stop")
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_a_request_that_can_never_fit_fails_instead_of_looping() -> None:
    s = make(num_blocks=3)
    big = req("big", 20)
    s.add(big)
    assert not s.schedule().scheduled
    assert s.failed == [big] and big.finish_reason == "error" and "KV blocks" in (big.error or "")


def test_kv_refcounts_and_prefix_cache_reuse() -> None:
    pytest.importorskip("packing.keys")
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = req("a", 10)
    assert kv.allocate(first, 10) is not None and len(first.block_ids) == 3
    first.num_computed_tokens = 10
    kv.cache_full_blocks(first)
    twin = req("b", 10)
    hit = kv.find_cached_blocks(twin)
    assert hit == first.block_ids[:2]  # two full blocks; the partial one is not shared
    kv.allocate(twin, 10, hit)
    assert [kv.blocks[b].ref_count for b in first.block_ids] == [2, 2, 1]
    kv.free(first)
    kv.free(twin)
    assert kv.num_free_blocks == 8
    # Freed blocks keep their hashes until the pool reuses them.
    again = req("c", 12)
    assert kv.find_cached_blocks(again) == hit
    hog = req("d", 32, start=500)
    assert kv.allocate(hog, 32) is not None  # takes all 8 blocks, evicting the cache
    assert kv.find_cached_blocks(again) == []
    assert kv.allocate(req("e", 4), 4) is None  # pool empty: nothing changes
