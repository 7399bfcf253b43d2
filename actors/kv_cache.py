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
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with no reference, oldest first: allocation takes (and evicts) from the front.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
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
            parent = hashes[-1] if hashes else None
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
                self._free[block_id] = None
                if block.block_hash is None:
                    # Nothing to revive: reuse it before blocks that cache a prefix.
                    self._free.move_to_end(block_id, last=False)
        request.block_ids = []
        request.num_hashed_blocks = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's `reset_prefix_cache`, e.g. to start a benchmark
        repetition cold). Only while no request holds a block: returns False and changes
        nothing otherwise."""
        if len(self._free) != len(self.blocks):
            return False
        self._hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        self._free = OrderedDict((i, None) for i in range(len(self.blocks)))
        return True

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict the cached prefix it held
            if self._hash_to_block.get(block.block_hash) == block_id:
                del self._hash_to_block[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id


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
    """Per layer (k, v), each `[num_blocks, block_size, num_kv_heads, head_dim]`."""
    storage = torch.zeros(
        (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
    )
    return [(storage[layer, 0], storage[layer, 1]) for layer in range(num_layers)]
