"""The `parsed` column's type from a JSON Schema, and its values from generated texts."""

from __future__ import annotations

import pyarrow as pa

from actors import SamplingParams
from pipeline.stages.parsed import arrow_type, parsed_column, parsed_type

OBJECT = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
        "where": {"type": "object", "properties": {"x": {"type": "number"}}},
    },
}


def test_simple_schemas_map_to_structs_and_others_to_none() -> None:
    assert arrow_type(OBJECT) == pa.struct(
        [
            ("name", pa.string()),
            ("age", pa.int64()),
            ("tags", pa.list_(pa.string())),
            ("where", pa.struct([("x", pa.float64())])),
        ]
    )
    assert arrow_type({"type": "array", "items": {"type": "string"}}) is None  # not an object
    assert arrow_type({"type": "object", "properties": {"a": {"anyOf": []}}}) is None
    assert arrow_type({"type": "object", "properties": {"a": {"$ref": "#/x"}}}) is None
    assert arrow_type({"type": "object"}) is None  # no fields to name


def test_the_column_type_follows_the_sampling() -> None:
    assert parsed_type(SamplingParams(), ()) is None
    assert parsed_type(SamplingParams(guided_decoding={"regex": "a"}), ()) is None
    assert parsed_type(SamplingParams(), ("guided_decoding",)) == pa.string()
    assert parsed_type(SamplingParams(guided_decoding={"json_object": True}), ()) == pa.string()
    by_schema = SamplingParams(guided_decoding={"json": OBJECT})
    assert parsed_type(by_schema, ()) == arrow_type(OBJECT)
    assert parsed_type(by_schema, ("guided_decoding",)) == pa.string()  # rows may differ


def test_values_parse_or_are_null() -> None:
    type_ = arrow_type(OBJECT)
    texts = ['{"name": "x", "age": 3}', '{"name": "x", "ag', None, '{"age": "old"}']
    assert parsed_column(texts, type_).to_pylist() == [
        {"name": "x", "age": 3, "tags": None, "where": None},
        None,
        None,
        None,
    ]
    assert parsed_column(['{"b": [1, 2]}', "no"], pa.string()).to_pylist() == ['{"b":[1,2]}', None]
