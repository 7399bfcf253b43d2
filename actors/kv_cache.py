"""The paged KV cache: a block pool with reference counts and prefix caching, and its tensors.

`KVCacheManager` owns block ids only (no tensors): which blocks a request holds, how many
requests share each block, and which full blocks are known by their chained block hash so an
identical leading block can be shared instead of recomputed (vLLM's prefix caching). A block
whose last reference is dropped goes to the free queue but keeps its hash, so it can still be
found and revived until the pool needs it for something else (least recently freed first).

Block hashes are chained (`hash_block`): a full block's hash covers its parent's hash and its
own tokens, so a request hashes each block once, when it fills, in O(block_size), instead of
rehashing the whole chain as the sequence grows. The bytes hashed are those of
`packing.keys.block_hashes`, so the planner and the cache agree on every block.

`allocate_kv_tensors` makes the storage the attention function reads and writes.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from actors.request import Request

logger = logging.getLogger(__name__)


@dataclass
class Block:
    """One block of `block_size` token slots."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and computed


class KVCacheManager:
    """Block ids, reference counts and the prefix cache of one engine's KV pool."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.blocks = _Blocks(num_blocks)
        # Blocks with no reference: allocation takes (and evicts) from the front.
        self._free = _FreeQueue(num_blocks)
        self._hash_to_block: dict[int, int] = {}
        self.enable_prefix_caching = enable_prefix_caching

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (some still cache a prefix and may be revived)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return 1.0 - len(self._free) / max(1, len(self.blocks))

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def block_hashes(self, request: Request) -> list[int]:
        """Chained hashes of the request's full blocks, extended by the blocks that filled
        since the last call (each block is hashed once, from its parent's hash)."""
        hashes = request.block_hashes
        size = self.block_size
        for index in range(len(hashes), request.num_tokens // size):
            # A salted request's chain starts from its salt (its KV depends on more than tokens).
            parent = hashes[-1] if hashes else request.cache_salt
            hashes.append(hash_block(parent, request.token_ids[index * size : (index + 1) * size]))
        return hashes

    def find_cached_blocks(self, request: Request) -> list[int]:
        """Blocks holding the longest run of the request's leading full blocks already computed.

        Stops one token short of the whole sequence: the last token must be computed in a
        step to produce the logits the next token is sampled from.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        found = []
        for block_hash in self.block_hashes(request)[:max_blocks]:
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def allocate(
        self, request: Request, num_tokens: int, shared_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Grow the request's block table to hold `num_tokens` tokens.

        `shared_blocks` (only when the table is empty: a new admission) are computed blocks
        taken by reference to start the table. Returns the newly allocated blocks, or None
        when the pool is short, in which case nothing changed.
        """
        assert not shared_blocks or not request.block_ids, "shared blocks start a table"
        num_new = self.blocks_for(num_tokens) - len(request.block_ids) - len(shared_blocks)
        revived = sum(1 for b in shared_blocks if self.blocks[b].ref_count == 0)
        if max(num_new, 0) + revived > len(self._free):
            return None
        for block_id in shared_blocks:
            self._take(block_id)
        request.block_ids.extend(shared_blocks)
        fresh = [self._pop_free() for _ in range(max(num_new, 0))]
        request.block_ids.extend(fresh)
        return fresh

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the hashes of the request's computed full blocks for later sharing."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        hashes = self.block_hashes(request)
        for index in range(request.num_hashed_blocks, num_full):
            block = self.blocks[request.block_ids[index]]
            if block.block_hash is None and hashes[index] not in self._hash_to_block:
                block.block_hash = hashes[index]
                self._hash_to_block[hashes[index]] = block.block_id
        request.num_hashed_blocks = max(request.num_hashed_blocks, num_full)

    def free(self, request: Request) -> None:
        """Drop the request's references; blocks nobody holds go to the free queue."""
        # Tail blocks first, so a partly evicted prefix loses its end, not its start.
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                # Nothing to revive: reuse it before blocks that cache a prefix.
                self._free.push(block_id, front=block.block_hash is None)
        request.block_ids = []
        request.num_hashed_blocks = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's `reset_prefix_cache`, e.g. to start a benchmark
        repetition cold). Only while no request holds a block: returns False and changes
        nothing otherwise."""
        if len(self._free) != len(self.blocks):
            return False
        self._hash_to_block.clear()
        self.blocks = _Blocks(len(self.blocks))
        self._free = _FreeQueue(len(self.blocks))
        return True

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._free.remove(block_id)
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id = self._free.pop()
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict the cached prefix it held
            if self._hash_to_block.get(block.block_hash) == block_id:
                del self._hash_to_block[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id


class _Blocks:
    """The pool's `Block`s by id, each made on first use: a pool sized by memory can have
    hundreds of thousands of blocks (a tiny model in 1 GB), and making them all up front cost
    a second of every engine's start-up."""

    def __init__(self, num_blocks: int):
        self._num_blocks = num_blocks
        self._made: dict[int, Block] = {}

    def __len__(self) -> int:
        return self._num_blocks

    def __getitem__(self, block_id: int) -> Block:
        block = self._made.get(block_id)
        if block is None:
            if not 0 <= block_id < self._num_blocks:
                raise IndexError(f"block {block_id} is not in a pool of {self._num_blocks}")
            block = self._made[block_id] = Block(block_id)
        return block


class _FreeQueue:
    """Blocks no request holds, in the order allocation takes them: blocks freed without a
    cached prefix (most recent first), then the never-used blocks in id order, then blocks
    that cache a prefix (least recently freed first, so the oldest prefix is evicted first).

    The never-used blocks are a range, not entries: one `OrderedDict` holding every id of a
    large pool cost a noticeable part of an engine's start-up."""

    def __init__(self, num_blocks: int):
        self._front: OrderedDict[int, None] = OrderedDict()
        self._next_unused = 0
        self._num_blocks = num_blocks
        self._back: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._front) + self._num_blocks - self._next_unused + len(self._back)

    def push(self, block_id: int, front: bool) -> None:
        """Queue a block whose last reference was dropped."""
        if front:
            self._front[block_id] = None
            self._front.move_to_end(block_id, last=False)
        else:
            self._back[block_id] = None

    def pop(self) -> int:
        """Take the first block in allocation order."""
        if self._front:
            return self._front.popitem(last=False)[0]
        if self._next_unused < self._num_blocks:
            self._next_unused += 1
            return self._next_unused - 1
        return self._back.popitem(last=False)[0]

    def remove(self, block_id: int) -> None:
        """Take a cached block out of the queue (it is being revived)."""
        if block_id in self._back:
            del self._back[block_id]
        else:
            del self._front[block_id]


def hash_block(parent: int | None, tokens: Sequence[int]) -> int:
    """The chained hash of one full block: 8-byte blake2b over the parent block's hash (8
    zero bytes for a sequence's first block) and the block's tokens as little-endian int32,
    read as a little-endian integer; the same bytes as `packing.keys.block_hashes`."""
    previous = bytes(8) if parent is None else parent.to_bytes(8, "little")
    data = np.asarray(tokens, dtype="<i4").tobytes()
    digest = hashlib.blake2b(previous + data, digest_size=8).digest()
    return int.from_bytes(digest, "little")


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of K and V for one block across all layers."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def allocate_kv_tensors(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k, v), each `[num_blocks, block_size, num_kv_heads, head_dim]`, zeroed."""
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    if torch.device(device).type == "cpu":
        # numpy's zeros is calloc: the pages come zeroed from the kernel on first touch, so a
        # pool costs memory and time only for the blocks used. torch.zeros writes every page
        # at start-up (2 s for 1 GB on this machine, the whole pool resident from then on).
        raw = np.zeros(math.prod(shape) * torch.empty((), dtype=dtype).element_size(), np.uint8)
        storage = torch.from_numpy(raw).view(dtype).view(shape)
    else:
        storage = torch.zeros(shape, dtype=dtype, device=device)
    return [(storage[layer, 0], storage[layer, 1]) for layer in range(num_layers)]
