"""The `parsed` output column: a JSON-guided row's output as the object it encodes.

Named after the OpenAI SDK's `message.parsed` (what `client.beta.chat.completions.parse`
returns for a `response_format` schema). When every row has the same JSON Schema (the
job's or processor's default, no per-row `guided_decoding`) and the schema maps simply to
Arrow (objects of strings, integers, numbers, booleans, string enums, arrays and nested such
objects), the column is a struct of those fields, so Parquet readers and Ray Data filter on
them directly. Otherwise (any JSON object, a schema with unions or references, per-row
schemas) it is the object as compact JSON text. A row whose text does not parse (cut at
max_tokens, an error row) has a null.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from actors.config import SamplingParams

PARSED = "parsed"
GUIDED_OVERRIDE = "guided_decoding"  # the per-row override column (--sampling-columns)
_SCALARS = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64()}
_SCALARS["boolean"] = pa.bool_()


def parsed_type(sampling: SamplingParams, override_columns: Sequence[str]) -> pa.DataType | None:
    """The `parsed` column's type, or None when rows get no such column (no JSON guidance by
    default and no per-row `guided_decoding` column)."""
    per_row = GUIDED_OVERRIDE in override_columns
    guided = sampling.guided_decoding
    if guided is None or guided.kind not in ("json", "json_object"):
        return pa.string() if per_row else None
    if per_row or guided.schema is None:
        return pa.string()
    return arrow_type(guided.schema) or pa.string()


def arrow_type(schema: Mapping[str, Any]) -> pa.DataType | None:
    """The Arrow type of values valid against `schema` when it is simple (see the module's
    docstring); None when it is not. The top level must be an object."""
    found = _type_of(schema)
    return found if isinstance(found, pa.StructType) else None


def _type_of(schema: Any) -> pa.DataType | None:
    if not isinstance(schema, Mapping):
        return None
    if any(k in schema for k in ("$ref", "anyOf", "oneOf", "allOf", "not", "if", "const")):
        return None
    if "enum" in schema:
        values = schema["enum"]
        if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
            return pa.string()
        return None
    kind = schema.get("type")
    if kind in _SCALARS:
        return _SCALARS[kind]
    if kind == "array":
        item = _type_of(schema.get("items"))
        return pa.list_(item) if item is not None else None
    if kind == "object":
        props = schema.get("properties")
        if not isinstance(props, Mapping) or not props or schema.get("additionalProperties"):
            return None
        fields = []
        for name, sub in props.items():
            sub_type = _type_of(sub)
            if sub_type is None:
                return None
            fields.append(pa.field(name, sub_type))
        return pa.struct(fields)
    return None


def parsed_column(texts: Sequence[str | None], type_: pa.DataType) -> pa.Array:
    """One value per text: the parsed JSON as `type_` (a struct) or as compact JSON text;
    null where a text is null or does not parse to a value of that type."""
    values: list[Any] = []
    for text in texts:
        try:
            value = json.loads(text) if text is not None else None
        except json.JSONDecodeError:
            value = None
        if value is not None and pa.types.is_string(type_):
            value = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        elif value is not None and not _fits(value, type_):
            value = None
        values.append(value)
    return pa.array(values, type_)


def _fits(value: Any, type_: pa.DataType) -> bool:
    try:
        pa.array([value], type_)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        return False
    return True
