"""The stage base class and the column names that pass between stages.

Each stage is a small callable over a pyarrow table (one Ray Data batch) that declares the
columns it needs; a missing column fails with a message naming what is missing and what
arrived (Ray Data LLM's pattern). Stages are plain callables, so tests run them without Ray.
"""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa

# Between the tokenizer and the planner: one row per input row.
ID = "id"
PROMPT_TOKEN_IDS = "prompt_token_ids"
NUM_PROMPT_TOKENS = "num_prompt_tokens"
SAMPLING = "sampling"  # JSON of the row's sampling overrides, null when none
ERROR = "error"
PREFIX_KEY = "prefix_key"  # packing.prefix_key of the first block, null when there is none
SHUFFLE_KEY = "shuffle_key"  # the prefix key, or a hash of the id for rows without one

# Between the planner and the engine actors: one row per shard, list columns per member.
SHARD = "shard"
GROUP_SIZES = "group_sizes"  # members of each first-level prefix group, in shard order
GROUP_PREFIX_LENS = "group_prefix_lens"  # tokens each group shares (0: nothing shared)
# What the engine gets: prefix groups over the shard's rows, possibly nested (parent -1: top).
PREFIX_GROUP_MEMBERS = "prefix_group_members"  # list of shard row indices per group
PREFIX_GROUP_PREFIX_LENS = "prefix_group_prefix_lens"
PREFIX_GROUP_PARENTS = "prefix_group_parents"

# What the engine actors write (plus the kept input columns and the text column).
GENERATED_TOKEN_IDS = "generated_token_ids"
FINISH_REASON = "finish_reason"
NUM_CACHED_TOKENS = "num_cached_tokens"
NUM_GENERATED_TOKENS = "num_generated_tokens"
TTFT = "time_to_first_token_s"
PREFIX_GROUP = "prefix_group"  # "<shard>/<group index>": rows computed with one shared prefix
SHARED_PREFIX_LEN = "shared_prefix_len"  # prompt tokens computed by a shared prefix, 0: none
SAMPLE_INDEX = "sample_index"  # 0..n-1: which of a row's samples (SamplingParams.n)
LOGPROBS = "logprobs"  # per generated token: id, log-probability, top alternatives (when asked)

TOKEN_LIST = pa.list_(pa.int32())


def output_schema(text_column: str) -> pa.Schema:
    """The engine's result columns in output order (the kept input columns come after id)."""
    return pa.schema(
        [
            (ID, pa.string()),
            (text_column, pa.string()),
            (GENERATED_TOKEN_IDS, TOKEN_LIST),
            (FINISH_REASON, pa.string()),
            (NUM_PROMPT_TOKENS, pa.int32()),
            (NUM_CACHED_TOKENS, pa.int32()),
            (NUM_GENERATED_TOKENS, pa.int32()),
            (TTFT, pa.float64()),
            (ERROR, pa.string()),
            (SHARD, pa.string()),
            (PREFIX_GROUP, pa.string()),
            (SHARED_PREFIX_LEN, pa.int32()),
        ]
    )


class Stage:
    """One step of the pipeline over a pyarrow table.

    Subclasses set `name`, return their needed columns from `required_columns` (with a
    sentence on what each means in `column_help`) and implement `process`.
    """

    name = "stage"

    def required_columns(self) -> tuple[str, ...]:
        """The columns every batch must have."""
        return ()

    def column_help(self) -> dict[str, str]:
        """What each required column means, for error messages."""
        return {}

    def check_columns(self, arrived: Iterable[str]) -> None:
        """Raise ValueError naming the missing columns and the ones that arrived."""
        arrived = list(arrived)
        missing = [c for c in self.required_columns() if c not in arrived]
        if missing:
            help_ = self.column_help()
            described = ", ".join(f"{c!r} ({help_[c]})" if c in help_ else repr(c) for c in missing)
            raise ValueError(
                f"{self.name} needs column(s) {described}; the batch has {sorted(arrived)}"
            )

    def __call__(self, batch: pa.Table) -> pa.Table:
        self.check_columns(batch.column_names)
        return self.process(batch)

    def process(self, batch: pa.Table) -> pa.Table:
        """Turn one batch into the next stage's batch."""
        raise NotImplementedError
