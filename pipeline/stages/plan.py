"""The planner: prefix groups inside one shuffle partition, their order, and shards.

After the shuffle by prefix key, every row that can share a prefix with another is in the
same partition. The partition's valid rows are sorted and compared once
(`packing.SortedSequences`); each key's rows go through `packing.group_prefixes` on their
part of that, the groups are
ordered by `packing.order_groups`, and cut into shards: whole groups up to a row and token
limit, so a group is never split between engine actors, unless it alone is over the limit,
when its parts each repeat the prefix (logged). The shards then run in the reverse of that
order (fewer engine steps, measured: see `plan_partition`). Rows without a shared prefix are
packed into the same shards, so the engine always sees many sequences at once.

Inside a shard the engine gets `packing.prefix_forest`'s nested groups over the shard's rows
(PlanConfig.nested; the shard's part of the same sorted rows): what the first-level groups share, and also what they share with each
other (a common opening) and what members share beyond their group's prefix.

The output is one row per shard with list columns (the members in shard order), the
first-level groups and the engine's groups (`pipeline/stages/group_columns.py` writes them, the
engine actor reads them back there); the engine actor consumes whole shard rows, so
batching cannot cut a group either.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from actors.config import SamplingParams
from packing import PrefixGroup, SortedSequences
from pipeline.config import PlanConfig
from pipeline.stages import dedupe, stage
from pipeline.stages.dedupe import DEDUPE_KEY
from pipeline.stages.engine_actor import ShardSpread
from pipeline.stages.group_columns import ShardGroups, group_columns
from pipeline.stages.logs import setup_worker_logging
from pipeline.stages.shard_cut import cut_shards
from pipeline.stages.stage import Stage

logger = logging.getLogger(__name__)


@dataclass
class PlanStats:
    """What the planner did to one partition (summed over partitions for the report)."""

    rows: int = 0
    error_rows: int = 0
    duplicate_rows: int = 0  # same id seen twice: generated once
    prompt_tokens: int = 0
    planned_saved_tokens: int = 0  # prompt tokens the engine groups compute once, not per row
    optimal_saved_tokens: int = 0  # the radix-tree optimum for the same rows
    num_shards: int = 0
    split_groups: int = 0
    share_degrees: Counter[int] = field(default_factory=Counter)  # group size -> groups

    def merge(self, other: PlanStats) -> None:
        """Add another partition's counts to these."""
        for name in (
            "rows",
            "error_rows",
            "duplicate_rows",
            "prompt_tokens",
            "planned_saved_tokens",
            "optimal_saved_tokens",
            "num_shards",
            "split_groups",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.share_degrees.update(other.share_degrees)


def group_rows(
    token_ids: Sequence[Sequence[int]],
    keys: Sequence[int | None],
    grouping: bool,
    index: SortedSequences | None = None,
) -> list[PrefixGroup]:
    """Prefix groups over valid rows: `packing.group_prefixes` (BatchLLM's first-level
    enlargement) inside each prefix key; rows with no key (or with grouping off) are groups
    of one. Rows are indices into `token_ids`; `index` is them sorted once
    (`SortedSequences.of(token_ids)`; made here when a key has two rows and none is given),
    each key's tree built from its part of it."""
    from packing import group_prefixes

    by_key: dict[int, list[int]] = {}
    groups: list[PrefixGroup] = []
    for i, key in enumerate(keys):
        if grouping and key is not None:
            by_key.setdefault(key, []).append(i)
        else:
            groups.append(PrefixGroup(0, (i,)))
    for members in by_key.values():
        if len(members) == 1:
            groups.append(PrefixGroup(0, (members[0],)))
            continue
        if index is None:
            index = SortedSequences.of(token_ids)
        # Every row of the bucket comes back in exactly one group (one-member groups share 0).
        for g in group_prefixes(index.subset(members)):
            groups.append(PrefixGroup(g.prefix_len, tuple(members[m] for m in g.members)))
    return groups


def order(
    groups: Sequence[PrefixGroup], prompt_lens: Sequence[int], decode_lens: Sequence[int]
) -> list[PrefixGroup]:
    """Groups in `packing.order_groups` order (BatchLLM: by decode-to-prefill ratio)."""
    from packing import order_groups

    return [groups[i] for i in order_groups(groups, list(prompt_lens), list(decode_lens))]


def plan_partition(
    table: pa.Table,
    config: PlanConfig,
    sampling: SamplingParams,
    keep_columns: Sequence[str],
    spread: ShardSpread | None = None,
) -> tuple[pa.Table, PlanStats]:
    """One shuffle partition of tokenized rows -> one row per shard, and what was planned.
    With `spread`, a small partition's shards pack fewer rows (`ShardSpread.rows_per_shard`)."""
    stats = PlanStats()
    # Rows are the same when their dedupe key is (pipeline/stages/dedupe.py), else their id.
    key_column = DEDUPE_KEY if DEDUPE_KEY in table.column_names else stage.ID
    ids = table.column(key_column).to_pylist()
    seen: set[str] = set()
    unique: list[int] = []
    for i, row_id in enumerate(ids):
        if row_id not in seen:
            seen.add(row_id)
            unique.append(i)
    stats.duplicate_rows = len(ids) - len(unique)
    if stats.duplicate_rows:
        logger.warning("%d rows repeat an id seen before: generated once", stats.duplicate_rows)
        table = table.take(unique)

    errors = table.column(stage.ERROR).to_pylist()
    valid = [i for i, e in enumerate(errors) if e is None]
    failed = [i for i, e in enumerate(errors) if e is not None]
    token_ids = token_arrays(table.column(stage.PROMPT_TOKEN_IDS))
    lens = table.column(stage.NUM_PROMPT_TOKENS).to_pylist()
    keys = table.column(stage.PREFIX_KEY).to_pylist()
    decode = _decode_lens(table.column(stage.SAMPLING).to_pylist(), sampling)

    # The radix tree's sort and LCPs, once per partition: the buckets', the shards' and the
    # optimum's trees come from it (`SortedSequences.subset`).
    index = None
    if config.prefix_grouping and len(valid) > 1:
        index = SortedSequences.of([token_ids[i] for i in valid])
    groups = group_rows(
        [token_ids[i] for i in valid], [keys[i] for i in valid], config.prefix_grouping, index
    )
    groups = [PrefixGroup(g.prefix_len, tuple(valid[r] for r in g.members)) for g in groups]
    if config.prefix_grouping:
        groups = order(groups, lens, decode)
    pack_rows = None
    if spread is not None:
        pack_rows = spread.rows_per_shard(len(valid), config.max_rows_per_shard)
    shards, stats.split_groups = cut_shards(
        groups, lens, config.max_rows_per_shard, config.max_tokens_per_shard, pack_rows
    )
    # With the ratio order, the shards run last-cut first: the lowest-ratio groups (long
    # prompts, shared by few) enter the engine first, the large shared groups of short prompts
    # last. Measured (benchmarks/order_steps.py, docs/benchmarks-job-engine.md): fewer engine
    # steps than the ratio order itself in every case tried, 3 of 150 on Alpaca (32- and 64-row
    # shards, 32 and 64 new tokens; the real engine 147 against 152; the job 149 against 153)
    # and 10 of 234 on HH-RLHF.
    if config.prefix_grouping:
        shards.reverse()
    for start in range(0, len(failed), config.max_rows_per_shard):
        chunk = failed[start : start + config.max_rows_per_shard]
        shards.insert(0, [PrefixGroup(0, (r,)) for r in chunk])

    stats.rows = len(unique)
    stats.error_rows = len(failed)
    stats.prompt_tokens = sum(lens[i] for i in valid)
    stats.num_shards = len(shards)
    shard_groups = []
    valid_index = {row: i for i, row in enumerate(valid)}
    for shard in shards:
        rows = [r for g in shard for r in g.members]
        if errors[rows[0]] is not None:  # an error shard: nothing runs
            shard_groups.append([])
            continue
        for g in shard:
            stats.share_degrees[len(g.members)] += 1
        shard_tokens = [token_ids[r] for r in rows]
        sorted_rows: Sequence[Sequence[int]] | SortedSequences = shard_tokens
        if index is not None and config.nested:  # the forest's tree: the shard's part of it
            sorted_rows = index.subset([valid_index[r] for r in rows])
        groups = shard_prefix_groups(shard, sorted_rows, config)
        shard_groups.append(groups)
        stats.planned_saved_tokens += saved_tokens(shard_tokens, groups)
    if index is not None:
        stats.optimal_saved_tokens = optimal_saved_tokens(index)
    return _shard_table(table, shards, shard_groups, keep_columns), stats


def shard_prefix_groups(
    shard: Sequence[PrefixGroup],
    token_ids: Sequence[Sequence[int]] | SortedSequences,
    config: PlanConfig,
) -> list[PrefixGroup]:
    """The engine's prefix groups over one shard's rows (indices in shard order): nested
    (`packing.prefix_forest`, over `token_ids`: the rows' tokens or their part of the
    partition's sorted rows) when configured, else the shard's first-level groups."""
    from packing.prefix import prefix_forest

    if config.prefix_grouping and config.nested:
        return prefix_forest(token_ids, min_shared=config.nested_min_shared)
    groups, start = [], 0
    for g in shard:
        if len(g.members) > 1 and g.prefix_len > 0:
            groups.append(PrefixGroup(g.prefix_len, tuple(range(start, start + len(g.members)))))
        start += len(g.members)
    return groups


def saved_tokens(token_ids: Sequence[Sequence[int]], groups: Sequence) -> int:
    """Prompt tokens the groups compute once instead of per row (packing.saving_ratio)."""
    from packing import saving_ratio

    total = sum(len(t) for t in token_ids)
    return round(saving_ratio(token_ids, groups) * total) if groups else 0


def optimal_saved_tokens(rows: SortedSequences) -> int:
    """Prompt tokens the best possible prefix sharing saves on these rows (packing's optimum)."""
    from packing import optimal_saving_ratio

    return round(optimal_saving_ratio(rows) * rows.num_tokens)


def token_arrays(column: pa.ChunkedArray | pa.ListArray) -> list:
    """Each row's token ids as a 1-D integer numpy view into the column's buffer (no copy;
    a null row is empty). packing takes arrays in one concatenate, where lists of Python ints
    are converted one by one (20k rows of 300 tokens: the plan 0.9 CPU s instead of 2.5)."""
    lists = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = lists.offsets.to_numpy()  # [num_rows + 1], into the unsliced values
    values = lists.values.to_numpy(zero_copy_only=False)
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(lists))]


def _decode_lens(sampling: Sequence[str | None], defaults: SamplingParams) -> list[int]:
    lens = []
    for text in sampling:
        overrides = json.loads(text) if text else {}
        lens.append(int(overrides.get("max_tokens", defaults.max_tokens)))
    return lens


def _shard_table(
    table: pa.Table,
    shards: Sequence[Sequence[PrefixGroup]],
    shard_groups: Sequence[Sequence[PrefixGroup]],
    keep_columns: Sequence[str],
) -> pa.Table:
    order_ = [r for shard in shards for g in shard for r in g.members]
    offsets = [0]
    for shard in shards:
        offsets.append(offsets[-1] + sum(len(g.members) for g in shard))
    offsets_arr = pa.array(offsets, pa.int32())
    taken = table.take(order_) if order_ else table.slice(0, 0)
    ids = taken.column(stage.ID).to_pylist()
    columns = {
        stage.SHARD: pa.array(
            [_shard_id(ids[offsets[s] : offsets[s + 1]]) for s in range(len(shards))], pa.string()
        ),
    }
    for name in (
        stage.ID,
        *keep_columns,
        stage.PROMPT_TOKEN_IDS,
        stage.NUM_PROMPT_TOKENS,
        stage.SAMPLING,
        stage.ERROR,
    ):
        values = taken.column(name).combine_chunks()
        columns[name] = pa.ListArray.from_arrays(offsets_arr, values)
    columns.update(
        group_columns(
            [ShardGroups(shard, groups) for shard, groups in zip(shards, shard_groups, strict=True)]
        )
    )
    return pa.table(columns)


def _shard_id(ids: Sequence[str]) -> str:
    # Deterministic, so a retried plan task names its shards the same way.
    return hashlib.sha1("\0".join(ids).encode()).hexdigest()[:12]


class PlanStage(Stage):
    """Ray Data UDF over one whole shuffle partition (batch_size=None): shard rows out; the
    partition's PlanStats go to `collector` (a Ray actor handle) when one is given."""

    name = "plan"

    def __init__(
        self,
        config: PlanConfig,
        sampling: SamplingParams,
        keep_columns: Sequence[str] = (),
        collector=None,  # noqa: ANN001 (ray.actor.ActorHandle of pipeline.io.report.StatsCollector)
        spread: ShardSpread | None = None,
    ):
        self.config = config
        self.sampling = sampling
        self.keep_columns = tuple(keep_columns)
        self.collector = collector
        self.spread = spread

    def required_columns(self) -> tuple[str, ...]:
        return (
            stage.ID,
            *self.keep_columns,
            stage.PROMPT_TOKEN_IDS,
            stage.NUM_PROMPT_TOKENS,
            stage.SAMPLING,
            stage.ERROR,
            stage.PREFIX_KEY,
        )

    def process(self, batch: pa.Table) -> pa.Table:
        setup_worker_logging()
        if self.collector is None or batch.num_rows == 0:
            shards, stats = plan_partition(
                batch, self.config, self.sampling, self.keep_columns, self.spread
            )
        else:
            import ray

            # Named by its sorted ids, so a plan task Ray retries keeps its claims and
            # replaces its stats record instead of adding a second one.
            partition = _shard_id(sorted(set(batch.column(stage.ID).to_pylist())))
            versions = ray.get(
                self.collector.versions.remote(batch.column(stage.ID).unique().to_pylist())
            )
            batch, not_first = dedupe.resolve(batch, versions, self.config.on_duplicate)
            batch, dropped = self._drop_ids_claimed_elsewhere(batch, partition)
            shards, stats = plan_partition(
                batch, self.config, self.sampling, self.keep_columns, self.spread
            )
            stats.duplicate_rows += dropped + not_first
            ray.get(self.collector.record_plan.remote(partition, stats))
        logger.info(
            "planned %d rows into %d shards: %d prefix groups shared, %d tokens saved of %d",
            stats.rows,
            stats.num_shards,
            sum(n for d, n in stats.share_degrees.items() if d > 1),
            stats.planned_saved_tokens,
            stats.prompt_tokens,
        )
        return shards

    def _drop_ids_claimed_elsewhere(self, batch: pa.Table, partition: str) -> tuple[pa.Table, int]:
        """The partition without rows whose id another partition claimed first (the
        collector holds every id planned so far), and how many were dropped.

        Duplicates inside one partition are left to `plan_partition` (the first wins). The
        claim is keyed by `partition`, so a plan task Ray retries gets the same ids back
        rather than losing them to its own earlier attempt.
        """
        import ray

        key_column = DEDUPE_KEY if DEDUPE_KEY in batch.column_names else stage.ID
        ids = batch.column(key_column).to_pylist()
        unique = list(dict.fromkeys(ids))
        claims = ray.get(self.collector.claim_ids.remote(partition, unique))
        owned = dict(zip(unique, claims, strict=True))
        keep = [owned[i] for i in ids]
        dropped = len(ids) - sum(keep)
        if dropped:
            logger.warning(
                "%d rows have an id another partition already planned: generated once, there",
                dropped,
            )
            batch = batch.filter(pa.array(keep, pa.bool_()))
        return batch, dropped
