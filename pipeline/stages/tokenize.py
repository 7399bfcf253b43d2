"""The tokenizer stage (a pool of CPU actors): prompt text, token ids, overrides, prefix key.

A row that cannot run (null, empty or non-text prompt, a bad sampling override, a prompt over
the context) leaves here with `error` set and no tokens; later stages pass it through to the
output untouched, so it never fails the job.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pyarrow as pa

from actors.config import SamplingParams
from pipeline.config import PromptConfig
from pipeline.stages import stage
from pipeline.stages.logs import setup_worker_logging
from pipeline.stages.prompts import (
    Prompt,
    PromptBuilder,
    RowError,
    merge_sampling,
    sampling_overrides,
)
from pipeline.stages.stage import Stage

if TYPE_CHECKING:
    from actors.loader import ResolvedModel

_INT64 = 2**64


class TokenizeStage(Stage):
    """Rows with an `id` in, one row each out: id, kept columns, prompt_token_ids,
    num_prompt_tokens, sampling (JSON overrides), error, prefix_key, shuffle_key.

    `max_model_len` is the model's context: a prompt needs room for one generated token.
    """

    name = "tokenize"

    def __init__(
        self,
        prompt: PromptConfig,
        *,
        model: str | ResolvedModel,
        max_model_len: int,
        sampling: SamplingParams,
        keep_columns: Sequence[str] = (),
        override_columns: Sequence[str] = (),
        key_block_size: int = 64,
        trust_remote_code: bool = False,
        tokenizer=None,  # noqa: ANN001 (HF tokenizer; tests pass one, actors load it)
    ):
        setup_worker_logging()
        if tokenizer is None:
            from actors.loader import load_tokenizer

            tokenizer = load_tokenizer(model, trust_remote_code)
        self.tokenizer = tokenizer
        self.prompt = prompt
        self.builder = PromptBuilder(prompt, tokenizer)
        self.max_model_len = max_model_len
        self.sampling = sampling
        self.keep_columns = tuple(keep_columns)
        self.override_columns = tuple(override_columns)
        self.key_block_size = key_block_size

    def required_columns(self) -> tuple[str, ...]:
        extra = (self.prompt.sampling_column,) if self.prompt.sampling_column else ()
        return (
            stage.ID,
            *self.prompt.source_columns,
            *self.keep_columns,
            *self.override_columns,
            *extra,
        )

    def column_help(self) -> dict[str, str]:
        help_ = {stage.ID: "the row id from the id stage"}
        help_.update({c: "prompt source" for c in self.prompt.source_columns})
        help_.update({c: "kept in the output" for c in self.keep_columns})
        help_.update({c: "sampling override" for c in self.override_columns})
        if self.prompt.sampling_column:
            help_[self.prompt.sampling_column] = "per-row sampling parameters"
        return help_

    def process(self, batch: pa.Table) -> pa.Table:
        from packing import prefix_key

        rows = batch.select(list(dict.fromkeys(self.required_columns()))).to_pylist()
        prompts: list[Prompt | None] = []
        errors: list[str | None] = []
        overrides: list[str | None] = []
        for row in rows:
            try:
                prompt = self.builder.source(row)
                found = sampling_overrides(row, self.override_columns, self.prompt.sampling_column)
                merge_sampling(self.sampling, found)  # validate now, not in the engine actor
            except RowError as exc:
                prompts.append(None)
                errors.append(str(exc))
                overrides.append(None)
                continue
            prompts.append(prompt)
            errors.append(None)
            overrides.append(json.dumps(found, sort_keys=True) if found else None)

        valid = [i for i, p in enumerate(prompts) if p is not None]
        # As Hugging Face: tokenizer(text), or apply_chat_template(..., tokenize=True).
        encoded = self.builder.encode([prompts[i] for i in valid])  # type: ignore[misc]
        token_ids: list[list[int]] = [[] for _ in rows]
        num_tokens = [0] * len(rows)
        for i, ids in zip(valid, encoded, strict=True):
            if isinstance(ids, RowError):
                errors[i] = str(ids)
                continue
            num_tokens[i] = len(ids)
            if not ids:
                errors[i] = "prompt is empty after tokenization"
            elif len(ids) + 1 > self.max_model_len:
                errors[i] = (
                    f"prompt has {len(ids)} tokens; with one generated token that exceeds "
                    f"the model's context of {self.max_model_len}"
                )
            else:
                token_ids[i] = list(ids)

        keys = [
            None if errors[i] else _signed(prefix_key(token_ids[i], block_size=self.key_block_size))
            for i in range(len(rows))
        ]
        ids_ = [row[stage.ID] for row in rows]
        shuffle_keys = [
            k if k is not None else _id_hash(i) for k, i in zip(keys, ids_, strict=True)
        ]
        for i in range(len(rows)):
            if errors[i] is not None:
                overrides[i] = None
        columns = {
            stage.ID: pa.array(ids_, pa.string()),
            **{c: batch.column(c) for c in self.keep_columns},
            stage.PROMPT_TOKEN_IDS: pa.array(token_ids, stage.TOKEN_LIST),
            stage.NUM_PROMPT_TOKENS: pa.array(num_tokens, pa.int32()),
            stage.SAMPLING: pa.array(overrides, pa.string()),
            stage.ERROR: pa.array(errors, pa.string()),
            stage.PREFIX_KEY: pa.array(keys, pa.int64()),
            stage.SHUFFLE_KEY: pa.array(shuffle_keys, pa.int64()),
        }
        return pa.table(columns)


def _signed(key: int | None) -> int | None:
    """An unsigned 64-bit hash as int64 (Arrow has no arbitrary-size ints)."""
    if key is None:
        return None
    key %= _INT64
    return key - _INT64 if key >= 2**63 else key


def _id_hash(row_id: str) -> int:
    # Rows with no prefix key spread over the shuffle partitions by id.
    return int.from_bytes(
        hashlib.blake2b(row_id.encode(), digest_size=8).digest(), "big", signed=True
    )
