"""The offline job's own column names, in one list, and the check of every flag that names a
column against them.

The job writes its output columns beside the input columns it keeps, and carries the kept
columns through its stages beside its working columns (token ids, the shard's list columns,
the dedupe content hash...). A kept column or a text column with one of those names would
overwrite the job's own column (or be overwritten by it): the ids doubled or lost on a rerun,
the generated text dropped, a shard column of the wrong type. So such a name is refused
before any work, naming the flag and the column.

The flags that only *read* an input column (the prompt, template fields, messages, sampling
columns, the id column) may name an output column: the input is read before those columns
exist. They may not name the job's internal columns (`_raypack_*`, which the id stage adds
beside the input's), nor read the input's `id` when another column gives the ids (the id
stage replaces `id` with them).
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeline.stages import dedupe, group_columns, parsed, stage

# What the job writes for every row (plus the text column and the kept input columns).
OUTPUT_COLUMNS = (
    stage.ID,
    stage.GENERATED_TOKEN_IDS,
    stage.FINISH_REASON,
    stage.NUM_PROMPT_TOKENS,
    stage.NUM_CACHED_TOKENS,
    stage.NUM_GENERATED_TOKENS,
    stage.TTFT,
    stage.ERROR,
    stage.SHARD,
    stage.PREFIX_GROUP,
    stage.SHARED_PREFIX_LEN,
    stage.LOGPROBS,
    stage.SAMPLE_INDEX,
    parsed.PARSED,
)
# What travels between the stages beside the kept columns and is not written.
WORKING_COLUMNS = (
    stage.PROMPT_TOKEN_IDS,
    stage.SAMPLING,
    stage.PREFIX_KEY,
    stage.SHUFFLE_KEY,
    *group_columns.COLUMNS,
)
# Added beside the input's own columns by the id stage: an input column may not be read by them.
INTERNAL_COLUMNS = (dedupe.CONTENT, dedupe.DEDUPE_KEY)
RESERVED_COLUMNS = (*OUTPUT_COLUMNS, *WORKING_COLUMNS, *INTERNAL_COLUMNS)


def check_written(flag: str, names: Iterable[str], text_column: str | None = None) -> None:
    """ValueError when a column the job writes or carries (`names`, given by `flag`) is one
    of the job's own columns, or the text column (`text_column`, when given)."""
    for name in names:
        if name in RESERVED_COLUMNS:
            raise ValueError(
                f"{flag} {name!r}: {name!r} is one of the job's own columns "
                f"{list(RESERVED_COLUMNS)}; rename the column or choose another name"
            )
        if text_column is not None and name == text_column:
            raise ValueError(
                f"{flag} {name!r}: {name!r} is the generated text's column (--text-column)"
            )


def check_read(flag: str, names: Iterable[str], id_column: str | None) -> None:
    """ValueError when an input column read by `flag` is one the id stage replaces: an
    internal column, or `id` while the ids come from another column (`id_column`)."""
    for name in names:
        if name in INTERNAL_COLUMNS:
            raise ValueError(
                f"{flag} {name!r}: column names {list(INTERNAL_COLUMNS)} are the job's own; "
                "rename the column"
            )
        if name == stage.ID and id_column not in (None, stage.ID):
            raise ValueError(
                f"{flag} {name!r}: the output's {stage.ID!r} holds the ids from --id-column "
                f"{id_column!r}, so the input's {stage.ID!r} column cannot be read as well; "
                "rename it, or use it as the id column"
            )
