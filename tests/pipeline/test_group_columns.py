"""pipeline/stages/group_columns.py: a shard's prefix groups written to Ray Data columns and read
back are the same `packing.PrefixGroup`s (no Ray)."""

from __future__ import annotations

import pyarrow as pa

from packing import PrefixGroup, prefix_forest
from pipeline.stages.group_columns import ShardGroups, group_columns, read_groups

SHARDS = [
    ShardGroups(  # nested engine groups under first-level groups, and rows alone
        first_level=[
            PrefixGroup(6, (0, 1, 2)),
            PrefixGroup(0, (3,)),
            PrefixGroup(4, (4, 5)),
            PrefixGroup(0, (6,)),
        ],
        engine=[
            PrefixGroup(2, (0, 1, 2, 4, 5)),
            PrefixGroup(6, (0, 1, 2), parent=0),
            PrefixGroup(9, (1, 2), parent=1),
            PrefixGroup(4, (4, 5), parent=0),
            PrefixGroup(3, (3, 6)),
        ],
    ),
    ShardGroups([PrefixGroup(0, (0,))], []),  # one row, nothing shared
    ShardGroups([PrefixGroup(0, (i,)) for i in range(3)], []),  # an error shard's rows
    ShardGroups([PrefixGroup(5, (0, 1))], [PrefixGroup(5, (0, 1))]),  # first level, flat
]


def test_groups_read_back_equal_the_groups_written():
    table = pa.table(group_columns(SHARDS))
    assert table.num_rows == len(SHARDS)
    for row, written in enumerate(SHARDS):
        read = read_groups(table, row)
        assert read == written
        assert all(type(g) is PrefixGroup for g in [*read.first_level, *read.engine])
    one = read_groups(table.slice(1, 1))  # a shard row as the engine stage gets it
    assert one == SHARDS[1] and one.num_rows == 1


def test_first_level_groups_are_written_by_size_and_read_as_shard_rows():
    # The planner's first-level groups hold partition rows; the shard's rows are them in order.
    planned = ShardGroups([PrefixGroup(3, (17, 40)), PrefixGroup(0, (2,))], [])
    read = read_groups(pa.table(group_columns([planned])))
    assert read.first_level == [PrefixGroup(3, (0, 1)), PrefixGroup(0, (2,))]


def test_what_each_row_gets():
    groups = SHARDS[0]
    assert groups.num_rows == 7
    assert groups.first_level_of_rows() == [0, 0, 0, 1, 2, 2, 3]
    # The deepest engine group holding the row; parents come first.
    assert groups.shared_prefix_lens() == [6, 9, 9, 3, 4, 4, 3]
    assert ShardGroups().first_level_of_rows() == ShardGroups().shared_prefix_lens() == []


def test_a_forest_round_trips():
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 7, 8], [1, 2, 7, 9], [5, 5], [1, 2, 3, 4, 5]]
    forest = prefix_forest(seqs, min_shared=1)
    assert any(g.parent is not None for g in forest)
    written = ShardGroups([PrefixGroup(0, (i,)) for i in range(len(seqs))], forest)
    assert read_groups(pa.table(group_columns([written]))) == written
