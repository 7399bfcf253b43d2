"""The KV cache manager's chained block hashes (incremental, and the planner's hashes), its free
queue's order and the pool's tensors."""

from __future__ import annotations

import random
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from actors import SamplingParams, kv_cache
from actors.kv_cache import KVCacheManager, hash_block
from actors.request import Request
from packing.keys import block_hashes


def test_hashes_grow_one_block_at_a_time_and_match_packing_keys(monkeypatch) -> None:
    size = 4
    kv = KVCacheManager(num_blocks=8, block_size=size)
    request = Request("r", [3, 1, 4, 1, 5, 9], SamplingParams())
    calls: list[int | None] = []

    def counting(parent: int | None, tokens) -> int:
        calls.append(parent)
        return hash_block(parent, tokens)

    monkeypatch.setattr(kv_cache, "hash_block", counting)
    for token in range(2, 60):  # a sequence growing by one token per step, hashed each step
        assert kv.block_hashes(request) == block_hashes(request.token_ids, size)
        request.append_token(token)
    # Each full block was hashed once, from its parent's hash: linear, not quadratic. (The
    # last check saw 63 tokens: 15 full blocks.)
    assert len(calls) == (request.num_tokens - 1) // size == 15
    assert calls[0] is None and calls[1:] == request.block_hashes[:14]


def test_a_block_hash_depends_on_its_parent() -> None:
    tokens = [7, 8, 9, 10]
    assert hash_block(None, tokens) != hash_block(hash_block(None, [1, 2, 3, 4]), tokens)
    assert hash_block(None, tokens) == block_hashes(tokens, 4)[0]
    assert 0 <= hash_block(2**64 - 1, tokens) < 2**64


@pytest.mark.parametrize("extra", [0, 1, 5])
def test_equal_leading_blocks_are_found_after_growth(extra: int) -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = Request("a", list(range(10)), SamplingParams())
    kv.block_hashes(first)  # hashed before it grows, as the scheduler does at admission
    for token in range(100, 100 + extra):
        first.append_token(token)
    kv.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    kv.cache_full_blocks(first)
    twin = Request("b", first.token_ids + [42], SamplingParams())
    assert kv.find_cached_blocks(twin) == first.block_ids[: first.num_tokens // 4]


def test_reset_prefix_cache_forgets_cached_blocks_only_when_all_are_free() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = Request("a", list(range(9)), SamplingParams())
    kv.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    kv.cache_full_blocks(first)
    twin = Request("b", list(range(9)), SamplingParams())
    assert kv.reset_prefix_cache() is False  # `first` still holds its blocks
    assert kv.find_cached_blocks(twin) == first.block_ids[:2]
    cached = first.block_ids[:2]
    kv.free(first)
    assert kv.find_cached_blocks(twin) == cached  # free, but still revivable
    assert kv.reset_prefix_cache() is True
    assert kv.find_cached_blocks(twin) == []
    assert kv.num_free_blocks == 8


def test_engine_reset_prefix_cache_starts_the_next_batch_cold(make_engine) -> None:
    engine = make_engine("llama", num_kv_blocks=64)
    prompt = list(range(5, 45))  # 40 tokens: two full 16-token blocks to share
    params = SamplingParams(max_tokens=3)
    first = engine.generate([prompt], params)[0]
    warm = engine.generate([prompt], params)[0]
    assert first.num_cached_tokens == 0 and warm.num_cached_tokens == 32
    assert engine.reset_prefix_cache() is True
    cold = engine.generate([prompt], params)[0]
    assert cold.num_cached_tokens == 0
    assert cold.token_ids == warm.token_ids == first.token_ids
    engine.add_request(prompt, params)
    assert engine.reset_prefix_cache() is False  # a request is unfinished


class _ReferenceQueue:
    """The free queue as one OrderedDict of every id (what the pool kept before its unused
    blocks became a range): hashless frees at the front, cached ones at the back."""

    def __init__(self, num_blocks: int):
        self.free = OrderedDict((i, None) for i in range(num_blocks))

    def push(self, block_id: int, front: bool) -> None:
        self.free[block_id] = None
        if front:
            self.free.move_to_end(block_id, last=False)

    def pop(self) -> int:
        return self.free.popitem(last=False)[0]


def test_blocks_are_taken_in_the_same_order_as_with_one_queue_of_every_id() -> None:
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=64, block_size=4)
    reference = _ReferenceQueue(64)
    held: list[Request] = []
    for step in range(400):
        if held and (rng.random() < 0.45 or kv.num_free_blocks < 8):
            request = held.pop(rng.randrange(len(held)))
            for block_id in reversed(request.block_ids):  # as `free` drops them
                if kv.blocks[block_id].ref_count == 1:
                    reference.push(block_id, front=kv.blocks[block_id].block_hash is None)
            kv.free(request)
            continue
        request = Request(
            f"r{step}", [rng.randrange(3) for _ in range(rng.randint(1, 12))], SamplingParams()
        )
        shared = kv.find_cached_blocks(request)  # revived from the queue if nobody holds them
        for block_id in shared:
            if kv.blocks[block_id].ref_count == 0:
                del reference.free[block_id]
        fresh = kv.allocate(request, request.num_tokens, shared)
        assert fresh == [reference.pop() for _ in fresh]
        if rng.random() < 0.5:  # some requests publish their full blocks as a cached prefix
            request.num_computed_tokens = request.num_tokens
            kv.cache_full_blocks(request)
        held.append(request)
        assert kv.num_free_blocks == len(reference.free)


def test_the_kv_pool_is_zeroed_and_resident_only_where_used() -> None:
    def rss_bytes() -> int:
        status = Path("/proc/self/status").read_text()
        return (
            int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
            * 1024
        )

    before = rss_bytes()
    layers = kv_cache.allocate_kv_tensors(4, 4096, 16, 8, 64, torch.float32, "cpu")  # 512 MiB
    assert rss_bytes() - before < 64 * 2**20  # not written up front
    k, v = layers[3]
    assert k.shape == v.shape == (4096, 16, 8, 64) and k.dtype == torch.float32
    assert not k[-1].any() and not v[123].any()
    k[7] = 1.0
    assert k[7].all() and not layers[2][0][7].any() and not v[7].any()
