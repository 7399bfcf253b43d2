"""Rows to prompts: stable ids, prompt text (column, template or chat messages), sampling overrides.

Pure Python over dict rows; the tokenizer stage and the tests call these directly. A problem
with one row raises `RowError`, which the caller turns into an error row.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa

from actors.config import SamplingParams
from pipeline import stage
from pipeline.config import PromptConfig
from pipeline.stage import Stage

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_INT_FIELDS = {"max_tokens", "top_k", "min_tokens", "seed", "logprobs"}


class RowError(ValueError):
    """This row cannot run; the message goes into its `error` column."""


def content_id(row: Mapping[str, Any]) -> str:
    """A stable id from a row's content (the same row always gets the same id)."""
    text = json.dumps(row, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:20]


class RowIdStage(Stage):
    """Give every row an `id` (the user's id column as text, else a content hash) and drop the
    rows whose id is in `done_ids` (already in the output: see pipeline/resume.py)."""

    name = "row ids"

    def __init__(self, id_column: str | None, done_ids: Iterable[str] = ()):
        self.id_column = id_column
        self.done_ids = frozenset(done_ids)

    def required_columns(self) -> tuple[str, ...]:
        return (self.id_column,) if self.id_column else ()

    def column_help(self) -> dict[str, str]:
        return {self.id_column: "the id column"} if self.id_column else {}

    def process(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        if self.id_column:
            ids = [
                content_id(row) if row[self.id_column] is None else str(row[self.id_column])
                for row in rows
            ]
        else:
            ids = [content_id(row) for row in rows]
        if stage.ID in batch.column_names:
            batch = batch.drop_columns([stage.ID])
        table = batch.add_column(0, stage.ID, pa.array(ids, pa.string()))
        if self.done_ids:
            keep = pa.array([i not in self.done_ids for i in ids], pa.bool_())
            table = table.filter(keep)
        return table


class PromptBuilder:
    """Builds a row's prompt text as `PromptConfig` says; `tokenizer` is needed only when the
    chat template is used."""

    def __init__(self, config: PromptConfig, tokenizer=None):  # noqa: ANN001 (HF tokenizer)
        if config.uses_chat_template and tokenizer is None:
            raise ValueError("a chat-templated prompt needs the tokenizer")
        self.config = config
        self.tokenizer = tokenizer

    def build(self, row: Mapping[str, Any]) -> str:
        """The prompt text for one row; RowError when the row cannot make one."""
        config = self.config
        if config.messages_column:
            return self._render(_messages(row[config.messages_column], config.messages_column))
        if config.prompt_column:
            text = _text(row[config.prompt_column], config.prompt_column)
        else:
            values = {}
            for name in config.template_fields:
                if row[name] is None:
                    raise RowError(f"column {name!r} is null")
                values[name] = row[name]
            text = config.template.format(**values)  # type: ignore[union-attr]
        if not text.strip():
            raise RowError("prompt is empty")
        if not config.chat:
            return text
        messages = [{"role": "user", "content": text}]
        if config.system_prompt:
            messages.insert(0, {"role": "system", "content": config.system_prompt})
        return self._render(messages)

    def _render(self, messages: list[dict[str, str]]) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # the template's own checks (roles, order) vary by model
            raise RowError(f"chat template failed: {exc}") from None


def sampling_overrides(
    row: Mapping[str, Any], override_columns: Iterable[str], sampling_column: str | None
) -> dict[str, Any]:
    """The row's sampling overrides: SamplingParams fields from the named columns (nulls mean
    "use the default") and from a dict / JSON column. RowError on an unknown field."""
    overrides: dict[str, Any] = {}
    if sampling_column is not None and row.get(sampling_column) is not None:
        value = row[sampling_column]
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise RowError(f"column {sampling_column!r} is not JSON: {exc}") from None
        if not isinstance(value, Mapping):
            raise RowError(
                f"column {sampling_column!r} must hold a dict of sampling fields, "
                f"got {type(value).__name__}"
            )
        unknown = [k for k in value if k not in SAMPLING_FIELDS]
        if unknown:
            raise RowError(f"unknown sampling override {unknown}; known: {list(SAMPLING_FIELDS)}")
        overrides.update({k: v for k, v in value.items() if v is not None})
    for name in override_columns:
        if row.get(name) is not None:
            overrides[name] = row[name]
    return {k: _coerce(k, v) for k, v in overrides.items()}


def merge_sampling(defaults: SamplingParams, overrides: Mapping[str, Any]) -> SamplingParams:
    """The defaults with the row's overrides; RowError naming the field on a bad value."""
    if not overrides:
        return defaults
    try:
        return dataclasses.replace(defaults, **overrides)
    except (TypeError, ValueError) as exc:
        raise RowError(f"invalid sampling override: {exc}") from None


def _coerce(name: str, value: Any) -> Any:
    # Parquet written from pandas stores integer columns with nulls as floats (5.0).
    if name in _INT_FIELDS and isinstance(value, float) and value.is_integer():
        return int(value)
    if name in ("stop", "stop_token_ids") and isinstance(value, list):
        return tuple(value)
    return value


def _text(value: Any, column: str) -> str:
    if value is None:
        raise RowError(f"prompt column {column!r} is null")
    if not isinstance(value, str):
        raise RowError(f"prompt column {column!r} holds {type(value).__name__}, not text")
    return value


def _messages(value: Any, column: str) -> list[dict[str, str]]:
    if value is None:
        raise RowError(f"messages column {column!r} is null")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowError(f"messages column {column!r} is not JSON: {exc}") from None
    if not isinstance(value, list) or not value:
        raise RowError(f"messages column {column!r} must hold a non-empty list of messages")
    messages = []
    for m in value:
        if (
            not isinstance(m, Mapping)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise RowError(
                f"messages column {column!r}: each message needs text 'role' and 'content', "
                f"got {m!r}"[:300]
            )
        messages.append({"role": m["role"], "content": m["content"]})
    return messages
