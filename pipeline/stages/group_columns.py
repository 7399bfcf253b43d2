"""A shard's prefix groups as Ray Data columns, both ways: the planner writes them
(`group_columns`), the engine actor reads them back (`read_groups`); nothing else touches
the group columns' layout.

A shard row carries two lists of `packing.PrefixGroup` over its rows:
- the first-level groups, the plan's (`group_sizes`, `group_prefix_lens`): contiguous runs
  of the shard's rows in order, covering every row once (a row alone is a group of one,
  prefix_len 0); each output row's `prefix_group` names its run;
- the engine's groups (`prefix_group_members`, `prefix_group_prefix_lens`,
  `prefix_group_parents`, -1: top level): what the engine computes once, nested when the
  plan made them so (`packing.prefix_forest`); a row may be in none.
Members read back are shard row indices (0 .. rows - 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from packing import PrefixGroup
from pipeline.stages import stage

COLUMNS = (
    stage.GROUP_SIZES,
    stage.GROUP_PREFIX_LENS,
    stage.PREFIX_GROUP_MEMBERS,
    stage.PREFIX_GROUP_PREFIX_LENS,
    stage.PREFIX_GROUP_PARENTS,
)


@dataclass(frozen=True)
class ShardGroups:
    """One shard's first-level groups (shard order) and the engine's groups over its rows."""

    first_level: Sequence[PrefixGroup] = field(default_factory=list)
    engine: Sequence[PrefixGroup] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        """The shard's rows: the first-level groups cover each once."""
        return sum(len(g.members) for g in self.first_level)

    def first_level_of_rows(self) -> list[int]:
        """Per shard row, the index of its first-level group."""
        return [g for g, group in enumerate(self.first_level) for _ in group.members]

    def shared_prefix_lens(self) -> list[int]:
        """Per shard row, the prompt tokens the engine's groups compute for it: the prefix_len
        of the deepest group holding it (parents come first), 0 in none."""
        shared = [0] * self.num_rows
        for g in self.engine:
            for r in g.members:
                shared[r] = g.prefix_len
        return shared


def group_columns(shards: Sequence[ShardGroups]) -> dict[str, pa.Array]:
    """The group columns of shard rows, one entry per shard.

    The first-level groups are written as their sizes and prefix lens (the shard's rows are
    their members in order), so their members may be numbered any way (the planner's are
    partition rows); the engine's groups' members must be shard row indices.
    """
    int_list = pa.list_(pa.int32())
    return {
        stage.GROUP_SIZES: pa.array(
            [[len(g.members) for g in s.first_level] for s in shards], int_list
        ),
        stage.GROUP_PREFIX_LENS: pa.array(
            [[g.prefix_len for g in s.first_level] for s in shards], int_list
        ),
        stage.PREFIX_GROUP_MEMBERS: pa.array(
            [[list(g.members) for g in s.engine] for s in shards], pa.list_(int_list)
        ),
        stage.PREFIX_GROUP_PREFIX_LENS: pa.array(
            [[g.prefix_len for g in s.engine] for s in shards], int_list
        ),
        stage.PREFIX_GROUP_PARENTS: pa.array(
            [[-1 if g.parent is None else g.parent for g in s.engine] for s in shards], int_list
        ),
    }


def read_groups(table: pa.Table, row: int = 0) -> ShardGroups:
    """Shard row `row`'s groups, members as shard row indices."""
    first_level, start = [], 0
    for size, prefix_len in zip(
        table.column(stage.GROUP_SIZES)[row].as_py(),
        table.column(stage.GROUP_PREFIX_LENS)[row].as_py(),
        strict=True,
    ):
        first_level.append(PrefixGroup(prefix_len, tuple(range(start, start + size))))
        start += size
    engine = [
        PrefixGroup(prefix_len, tuple(members), None if parent < 0 else parent)
        for members, prefix_len, parent in zip(
            table.column(stage.PREFIX_GROUP_MEMBERS)[row].as_py(),
            table.column(stage.PREFIX_GROUP_PREFIX_LENS)[row].as_py(),
            table.column(stage.PREFIX_GROUP_PARENTS)[row].as_py(),
            strict=True,
        )
    ]
    return ShardGroups(first_level, engine)
