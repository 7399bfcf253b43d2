"""The processor's own stages around the shared path (pipeline/processor/build.py): in, token ids, out.

- `IntakeStage` keys every row and sets its input columns aside in one struct column, so they
  travel through tokenizing, the shuffle, the plan and the engine unchanged whatever their
  names and types, and come back once per row;
- `TokenIdsStage` stands in for the tokenizer stage when the prompts are token ids already;
- `OutflowStage` puts the input columns back and keeps the generated columns a user needs.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence

import pyarrow as pa

from actors.config import SamplingParams
from pipeline.stages import stage
from pipeline.stages.prompts import RowError, merge_sampling, sampling_overrides
from pipeline.stages.stage import Stage
from pipeline.stages.tokenize import _id_hash, _signed

INPUT = "_raypack_input"  # struct of the row's input columns, from intake to outflow
_NO_COLUMNS = "_raypack_no_input_columns"  # a struct needs a field


class IntakeStage(Stage):
    """Any input batch -> `id` (a fresh key per row: every row is generated, identical ones
    too), the prompt's source columns under their own names (for the tokenizer), and every
    input column inside the struct column `INPUT`.

    ValueError (it stops the dataset: a wrong column name is the program's bug, not a row's)
    when a needed column is missing or an input column has an output column's name."""

    name = "processor intake"

    def __init__(self, needed: dict[str, str], outputs: Sequence[str], sources: Sequence[str]):
        self.needed = dict(needed)  # column -> why it is needed
        self.outputs = tuple(outputs)
        self.sources = tuple(sources)  # what the tokenizer reads, under its own name

    def check(self, names: Sequence[str]) -> None:
        """ValueError naming a missing column or one that clashes with an output column."""
        names = list(names)
        missing = {c: why for c, why in self.needed.items() if c not in names}
        if missing:
            described = "; ".join(f"{c!r} ({why})" for c, why in missing.items())
            raise ValueError(f"the dataset has no column {described}. Its columns: {names}")
        clash = [c for c in names if c in self.outputs]
        if clash:
            raise ValueError(
                f"input column(s) {clash} have the names of the processor's output columns "
                f"{list(self.outputs)}: rename them first (ds.rename_columns)"
            )

    def process(self, batch: pa.Table) -> pa.Table:
        names = batch.column_names
        self.check(names)
        carried = pa.StructArray.from_arrays(
            [batch.column(c).combine_chunks() for c in names] or [pa.nulls(batch.num_rows)],
            names or [_NO_COLUMNS],
        )
        keys = [uuid.uuid4().hex for _ in range(batch.num_rows)]
        columns = {stage.ID: pa.array(keys, pa.string())}
        for c in self.sources:
            columns[c] = batch.column(c)
        columns[INPUT] = carried
        return pa.table(columns)


class TokenIdsStage(Stage):
    """The tokenizer stage's output (pipeline/stages/tokenize.py) for prompts that are token ids.

    A row whose ids are null, empty, not integers, outside the model's vocabulary, or too long
    for the context, or whose sampling overrides are bad, gets `error` and skips the engine.
    """

    name = "token ids"

    def __init__(
        self,
        column: str,
        *,
        max_model_len: int,
        vocab_size: int,
        sampling: SamplingParams,
        keep_columns: Sequence[str] = (),
        override_columns: Sequence[str] = (),
        sampling_column: str | None = None,
        key_block_size: int = 64,
    ):
        self.column = column
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.sampling = sampling
        self.keep_columns = tuple(keep_columns)
        self.override_columns = tuple(override_columns)
        self.sampling_column = sampling_column
        self.key_block_size = key_block_size

    def required_columns(self) -> tuple[str, ...]:
        extra = (self.sampling_column,) if self.sampling_column else ()
        return (stage.ID, self.column, *self.keep_columns, *self.override_columns, *extra)

    def process(self, batch: pa.Table) -> pa.Table:
        from packing import prefix_key

        rows = batch.select(list(dict.fromkeys(self.required_columns()))).to_pylist()
        token_ids: list[list[int]] = []
        errors: list[str | None] = []
        overrides: list[str | None] = []
        for row in rows:
            try:
                ids = self._ids(row[self.column])
                found = sampling_overrides(row, self.override_columns, self.sampling_column)
                merge_sampling(self.sampling, found)  # validate now, not in the engine actor
            except RowError as exc:
                token_ids.append([])
                errors.append(str(exc))
                overrides.append(None)
                continue
            token_ids.append(ids)
            errors.append(None)
            overrides.append(json.dumps(found, sort_keys=True) if found else None)
        keys = [
            None if e else _signed(prefix_key(t, block_size=self.key_block_size))
            for t, e in zip(token_ids, errors, strict=True)
        ]
        ids_ = [row[stage.ID] for row in rows]
        return pa.table(
            {
                stage.ID: pa.array(ids_, pa.string()),
                **{c: batch.column(c) for c in self.keep_columns},
                stage.PROMPT_TOKEN_IDS: pa.array(token_ids, stage.TOKEN_LIST),
                stage.NUM_PROMPT_TOKENS: pa.array([len(t) for t in token_ids], pa.int32()),
                stage.SAMPLING: pa.array(overrides, pa.string()),
                stage.ERROR: pa.array(errors, pa.string()),
                stage.PREFIX_KEY: pa.array(keys, pa.int64()),
                stage.SHUFFLE_KEY: pa.array(
                    [k if k is not None else _id_hash(i) for k, i in zip(keys, ids_, strict=True)],
                    pa.int64(),
                ),
            }
        )

    def _ids(self, value: object) -> list[int]:
        where = f"token ids column {self.column!r}"
        if value is None:
            raise RowError(f"{where} is null")
        if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        ):
            raise RowError(f"{where} must hold a list of integers, got {str(value)[:100]}")
        if not value:
            raise RowError(f"{where} is empty")
        for pos, t in enumerate(value):
            if not 0 <= t < self.vocab_size:
                raise RowError(
                    f"{where}: token id {t} at position {pos} is outside the model's "
                    f"vocabulary [0, {self.vocab_size})"
                )
        if len(value) + 1 > self.max_model_len:
            raise RowError(
                f"prompt has {len(value)} tokens; with one generated token that exceeds the "
                f"model's context of {self.max_model_len}"
            )
        return value


class OutflowStage(Stage):
    """Engine rows -> the input columns as they came in, then `columns` (the generated
    columns a user needs: `ProcessorConfig.output_columns`)."""

    name = "processor outflow"

    def __init__(self, columns: Sequence[str]):
        self.columns = tuple(columns)

    def required_columns(self) -> tuple[str, ...]:
        return (INPUT, *self.columns)

    def process(self, batch: pa.Table) -> pa.Table:
        carried = batch.column(INPUT).combine_chunks()
        fields = [f.name for f in carried.type]
        columns: dict[str, pa.Array | pa.ChunkedArray] = {}
        if fields != [_NO_COLUMNS]:
            # flatten() (not field()) honours the array's offset: a sliced batch stays aligned.
            columns.update(zip(fields, carried.flatten(), strict=True))
        for name in self.columns:
            columns[name] = batch.column(name)
        return pa.table(columns)
