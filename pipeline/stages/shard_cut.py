"""Shards from ordered prefix groups: whole groups up to a shard's row and token limits, a
group over either limit alone split into parts that each repeat its prefix; a small partition
spread over several engine actors dealt over its shards (`ShardSpread`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from packing import PrefixGroup

logger = logging.getLogger(__name__)


def group_tokens(group: PrefixGroup, prompt_lens: Sequence[int]) -> int:
    """Prompt tokens a group computes: its prefix once, then each member's rest."""
    return sum(prompt_lens[r] for r in group.members) - group.prefix_len * (len(group.members) - 1)


def cut_shards(
    groups: Sequence[PrefixGroup],
    prompt_lens: Sequence[int],
    max_rows: int,
    max_tokens: int,
    pack_rows: int | None = None,
) -> tuple[list[list[PrefixGroup]], int]:
    """Shards of whole groups in the given order, each within `max_rows` rows and
    `max_tokens` prompt tokens; a group over either limit alone is split into parts that each
    repeat its prefix. Returns the shards and how many groups were split.

    With `pack_rows` below `max_rows` (a small partition spread over several engine actors,
    `ShardSpread`), the groups are dealt over as many shards as `pack_rows` rows each need
    (`_deal`), so every shard holds a slice of the whole order rather than one end of it. A
    group larger than `pack_rows` still stays whole up to `max_rows`: spreading never costs a
    prefix computed twice."""
    parts: list[PrefixGroup] = []
    split = 0
    for group in groups:
        if len(group.members) <= max_rows and group_tokens(group, prompt_lens) <= max_tokens:
            parts.append(group)
            continue
        pieces = _split(group, prompt_lens, max_rows, max_tokens)
        parts.extend(pieces)
        if len(pieces) > 1:
            split += 1
            logger.info(
                "prefix group of %d rows (prefix %d tokens) is over a shard's limit "
                "(%d rows, %d tokens): split into %d shards, the prefix computed in each",
                len(group.members),
                group.prefix_len,
                max_rows,
                max_tokens,
                len(pieces),
            )
    if pack_rows is not None and pack_rows < max_rows:
        return _deal(parts, prompt_lens, pack_rows, max_rows, max_tokens), split
    shards: list[list[PrefixGroup]] = []
    current: list[PrefixGroup] = []
    rows = tokens = 0
    for part in parts:
        cost = group_tokens(part, prompt_lens)
        if current and (rows + len(part.members) > max_rows or tokens + cost > max_tokens):
            shards.append(current)
            current, rows, tokens = [], 0, 0
        current.append(part)
        rows += len(part.members)
        tokens += cost
    if current:
        shards.append(current)
    return shards, split


def _deal(
    parts: Sequence[PrefixGroup],
    prompt_lens: Sequence[int],
    pack_rows: int,
    max_rows: int,
    max_tokens: int,
) -> list[list[PrefixGroup]]:
    """`parts` in order, each to the shard with the fewest rows so far (ties: the first),
    over ceil(rows / `pack_rows`) shards, more only when none has room within `max_rows` and
    `max_tokens`.

    Cut in order, the shards of a spread partition each held one stretch of the plan's order
    (short prompts at one end, long ones at the other), so equal rows were not equal work:
    525 Alpaca rows in four shards held 5,095-8,835 prompt tokens each, dealt 6,429-6,621
    (docs/benchmarks-job-engine.md)."""
    total = sum(len(p.members) for p in parts)
    count = max(1, -(-total // pack_rows))
    shards: list[list[PrefixGroup]] = [[] for _ in range(count)]
    rows, tokens = [0] * count, [0] * count
    for part in parts:
        size, cost = len(part.members), group_tokens(part, prompt_lens)
        room = [
            i
            for i in range(len(shards))
            if not shards[i] or (rows[i] + size <= max_rows and tokens[i] + cost <= max_tokens)
        ]
        if not room:
            shards.append([])
            rows.append(0)
            tokens.append(0)
            room = [len(shards) - 1]
        best = min(room, key=lambda i: rows[i])
        shards[best].append(part)
        rows[best] += size
        tokens[best] += cost
    return [shard for shard in shards if shard]


def _split(
    group: PrefixGroup, prompt_lens: Sequence[int], max_rows: int, max_tokens: int
) -> list[PrefixGroup]:
    parts: list[PrefixGroup] = []
    current: list[int] = []
    tokens = group.prefix_len
    for r in group.members:
        rest = prompt_lens[r] - group.prefix_len
        if current and (len(current) + 1 > max_rows or tokens + rest > max_tokens):
            parts.append(PrefixGroup(group.prefix_len, tuple(current)))
            current, tokens = [], group.prefix_len
        current.append(r)
        tokens += rest
    parts.append(PrefixGroup(group.prefix_len, tuple(current)))
    # A part of one row shares nothing.
    return [p if len(p.members) > 1 else PrefixGroup(0, p.members) for p in parts]
