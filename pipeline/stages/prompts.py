"""Rows to prompts: stable ids, prompt text (column, template or chat messages), sampling overrides.

Pure Python over dict rows; the tokenizer stage and the tests call these directly. A problem
with one row raises `RowError`, which the caller turns into an error row.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import string
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from actors.config import SamplingParams
from actors.tokenization import ChatTemplateError, encode_chat, encode_texts, render_chat
from pipeline.config import PromptConfig
from pipeline.io.done_ids import DoneIds
from pipeline.stages import dedupe, stage
from pipeline.stages.stage import Stage

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_INT_FIELDS = {"max_tokens", "top_k", "min_tokens", "seed", "logprobs", "n", "best_of"}
Prompt = str | list[dict[str, str]]  # a text prompt, or chat messages


class RowError(ValueError):
    """This row cannot run; the message goes into its `error` column."""


def content_id(row: Mapping[str, Any]) -> str:
    """A stable id from a row's content (the same row always gets the same id)."""
    text = json.dumps(row, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:20]


class RowIdStage(Stage):
    """Give every row an `id` (the user's id column as text, else a content hash) and drop the
    rows whose id is in `done_ids` (already in the output: see pipeline/io/resume.py; a
    `DoneIds`, or any ids, made into one)."""

    name = "row ids"

    def __init__(
        self,
        id_column: str | None,
        done_ids: Iterable[str] | DoneIds = (),
        collector=None,  # noqa: ANN001 (actor handle of pipeline.io.report.StatsCollector)
    ):
        self.id_column = id_column
        self.done_ids = done_ids if isinstance(done_ids, DoneIds) else DoneIds.of(done_ids)
        self.collector = collector

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
        # The row's content, so rows that share an id can be told apart (pipeline/stages/dedupe.py).
        hashes = ids if self.id_column is None else [content_id(row) for row in rows]
        # The input's own `id` and a column named like the content hash make way for ours
        # (pipeline/stages/columns.py refuses flags that would read them).
        replaced = [c for c in (stage.ID, dedupe.CONTENT) if c in batch.column_names]
        if replaced:
            batch = batch.drop_columns(replaced)
        table = batch.add_column(0, stage.ID, pa.array(ids, pa.string()))
        table = table.append_column(dedupe.CONTENT, pa.array(hashes, pa.string()))
        if self.done_ids:
            keep = [i not in self.done_ids for i in ids]
            rows = [r for r, k in zip(rows, keep, strict=True) if k]
            table = table.filter(pa.array(keep, pa.bool_()))
        if self.collector is not None and table.num_rows:
            self._register(table, rows)
        return table

    def _register(self, table: pa.Table, rows: list[dict[str, Any]]) -> None:
        import ray

        ids = table.column(stage.ID).to_pylist()
        hashes = table.column(dedupe.CONTENT).to_pylist()
        conflicts = ray.get(self.collector.register_rows.remote(ids, hashes))
        if any(conflicts):
            described = [
                (i, h, dedupe.preview(row))
                for i, h, row, c in zip(ids, hashes, rows, conflicts, strict=True)
                if c
            ]
            ray.get(self.collector.describe_rows.remote(described))


class PromptBuilder:
    """Builds a row's prompt as `PromptConfig` says; `tokenizer` is needed only when the chat
    template is used. `source` gives what is tokenized (text, or chat messages), `encode`
    tokenizes such prompts (actors/tokenization.py), `build` gives the prompt's text."""

    def __init__(self, config: PromptConfig, tokenizer=None):  # noqa: ANN001 (HF tokenizer)
        if config.uses_chat_template and tokenizer is None:
            raise ValueError("a chat-templated prompt needs the tokenizer")
        self.config = config
        self.tokenizer = tokenizer

    def build(self, row: Mapping[str, Any]) -> str:
        """The prompt text for one row (a chat rendered by its template); RowError when the row
        cannot make one."""
        prompt = self.source(row)
        if isinstance(prompt, str):
            return prompt
        try:
            return render_chat(
                self.tokenizer,
                prompt,
                chat_template=self.config.chat_template,
                template_kwargs=self.config.chat_template_kwargs,
            )
        except ChatTemplateError as exc:  # the template's own checks (roles, order) vary by model
            raise RowError(f"chat template failed: {exc}") from None

    def encode(self, prompts: Sequence[Prompt]) -> list[list[int] | RowError]:
        """The token ids of each prompt from `source` (text as `tokenizer(text)`, chats as
        `apply_chat_template(..., tokenize=True)`), or the RowError of a chat its template
        rejects. Texts are tokenized in one batched call."""
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        encoded = encode_texts(
            self.tokenizer,
            [prompts[i] for i in texts],  # type: ignore[misc]
            add_special_tokens=self.config.add_special_tokens,
        )
        out: list[list[int] | RowError] = [[] for _ in prompts]
        for i, ids in zip(texts, encoded, strict=True):
            out[i] = ids
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str):
                try:
                    out[i] = encode_chat(
                        self.tokenizer,
                        prompt,
                        allow_special_tokens=self.config.allow_special_tokens_in_messages,
                        chat_template=self.config.chat_template,
                        template_kwargs=self.config.chat_template_kwargs,
                    )
                except ChatTemplateError as exc:
                    out[i] = RowError(f"chat template failed: {exc}")
        return out

    def source(self, row: Mapping[str, Any]) -> Prompt:
        """The row's prompt: its text, or its chat messages; RowError when the row cannot make
        one."""
        config = self.config
        if config.messages_column:
            return _messages(row[config.messages_column], config.messages_column)
        if config.prompt_column:
            text = _text(row[config.prompt_column], config.prompt_column)
        else:
            values = {}
            for name in config.template_fields:
                if row[name] is None:
                    raise RowError(f"column {name!r} is null")
                values[name] = row[name]
            text = _render(config.template, values)  # type: ignore[arg-type]
        if not text.strip():
            raise RowError("prompt is empty")
        if not config.chat:
            return text
        messages = [{"role": "user", "content": text}]
        if config.system_prompt:
            messages.insert(0, {"role": "system", "content": config.system_prompt})
        return messages


class SamplingOverrides(dict):
    """A row's sampling overrides (field -> value), remembering the column each came from so
    an error can name it. A plain dict to everything else (it is stored as JSON)."""

    def __init__(self, values: Mapping[str, Any] = (), columns: Mapping[str, str] = ()):  # type: ignore[assignment]
        super().__init__(values)
        self.columns: dict[str, str] = dict(columns)

    def describe(self, name: str) -> str:
        """Where field `name` came from, for a message: "column 'seed'" or "column 'sp'
        (field 'seed')"."""
        column = self.columns.get(name, name)
        return f"column {column!r}" + ("" if column == name else f" (field {name!r})")


def sampling_overrides(
    row: Mapping[str, Any], override_columns: Iterable[str], sampling_column: str | None
) -> SamplingOverrides:
    """The row's sampling overrides: SamplingParams fields from the named columns (nulls mean
    "use the default") and from a dict / JSON column, each coerced to its declared type (a
    CSV column arrives as text). RowError on an unknown field or a value that is not of the
    field's type, naming the column and the value."""
    values: dict[str, Any] = {}
    columns: dict[str, str] = {}
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
        for k, v in value.items():
            if v is not None:
                values[k], columns[k] = v, sampling_column
    for name in override_columns:
        value = row.get(name)
        # An empty CSV cell is text "": like a null, it means "use the default".
        if value is not None and not (isinstance(value, str) and not value.strip()):
            values[name], columns[name] = value, name
    found = SamplingOverrides(columns=columns)
    for k, v in values.items():
        found[k] = _coerce(k, v, found.describe(k))
    return found


def merge_sampling(defaults: SamplingParams, overrides: Mapping[str, Any]) -> SamplingParams:
    """The defaults with the row's overrides; RowError naming the column, the field, its value
    and the allowed range (SamplingParams' own message) on a bad value."""
    if not overrides:
        return defaults
    try:
        return dataclasses.replace(defaults, **overrides)
    except (TypeError, ValueError) as exc:
        where = _culprit(defaults, overrides)
        raise RowError(f"invalid sampling override{where}: {exc}") from None


def _culprit(defaults: SamplingParams, overrides: Mapping[str, Any]) -> str:
    """ " in column 'x'" for the first override that is invalid on its own ("" if only the
    combination is: min_tokens over max_tokens)."""
    for name, value in overrides.items():
        try:
            dataclasses.replace(defaults, **{name: value})
        except (TypeError, ValueError):
            if isinstance(overrides, SamplingOverrides):
                return f" in {overrides.describe(name)}"
            return f" {name!r}"
    return ""


# The declared type of each SamplingParams field a value is coerced to.
_FLOAT_FIELDS = {
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
}
_TRUE, _FALSE = {"true", "1", "yes"}, {"false", "0", "no"}


def _coerce(name: str, value: Any, where: str) -> Any:
    """`value` as field `name`'s declared type. Parquet from pandas stores integer columns with
    nulls as floats (5.0), and CSV columns may be text ("0.7"). Values of the right type are
    returned as they are: their range is SamplingParams' to check."""
    if name in _INT_FIELDS:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            return _parse(value, name, where, _int_text)
    elif name in _FLOAT_FIELDS:
        if isinstance(value, str):
            return _parse(value, name, where, float)
    elif name == "ignore_eos":
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
    elif name == "stop":
        if isinstance(value, list):
            return tuple(value)
    elif name == "logit_bias":
        if isinstance(value, str):  # a column of JSON objects: {"token id": bias}
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                raise RowError(f"{where}: logit_bias is not a JSON object: {exc}") from None
    elif name == "stop_token_ids":
        if isinstance(value, list):
            return tuple(
                _parse(v, name, where, _int_text) if isinstance(v, str) else v for v in value
            )
    return value


def _int_text(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        number = float(text)  # "5.0" and "1e3" are integers too
        if not number.is_integer():
            raise
        return int(number)


def _parse(text: str, name: str, where: str, parse: Any) -> Any:
    try:
        return parse(text.strip())
    except (ValueError, OverflowError):
        kind = "an integer" if parse is _int_text else "a number"
        raise RowError(f"{where}: {text[:100]!r} is not {kind} ({name} must be {kind})") from None


# A field's width or precision at most this: `{prompt:>{n}}` with n = 10**9 would build a
# gigabyte before the prompt's length is ever checked. A prompt that long exceeds any context.
MAX_FORMAT_WIDTH = 1_000_000


class _RowFormatter(string.Formatter):
    """`str.format` as Python's own Formatter does it (nested specs, conversions), with the
    widths and precisions a row's values give bounded."""

    def format_field(self, value: Any, format_spec: str) -> Any:
        numbers = [int(d) for d in re.findall(r"\d+", format_spec)]
        if numbers and max(numbers) > MAX_FORMAT_WIDTH:
            raise ValueError(f"format spec {format_spec!r} asks for over {MAX_FORMAT_WIDTH} chars")
        return super().format_field(value, format_spec)


def _render(template: str, values: Mapping[str, Any]) -> str:
    """The template over one row's values; RowError on anything the row's values make
    `format` raise (a spec that does not fit the value's type, a bad nested width...), so
    one row never stops the job."""
    try:
        return _RowFormatter().vformat(template, (), values)
    except Exception as exc:  # noqa: BLE001 (format raises what the value's __format__ does)
        raise RowError(f"template cannot render this row: {type(exc).__name__}: {exc}") from None


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
