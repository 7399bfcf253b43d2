"""Guided decoding through the processor: `SamplingParams(guided_decoding=...)` holds every
row to a JSON Schema, and the `parsed` column is a struct of the schema's fields."""

from __future__ import annotations

import json

import jsonschema
import pyarrow as pa
import pytest

from actors import EngineConfig, SamplingParams
from pipeline import ProcessorConfig, build_processor
from pipeline.config import ComputeConfig, PlanConfig
from tests.actors.test_guided import SCHEMA

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PROMPTS = ["Label the animal: woof.", "Label: tweet tweet.", "Meow?", "What barks?", "Fish."]


def test_processor_rows_validate_and_parsed_is_a_struct(ray_cluster, tiny_model_dir) -> None:  # noqa: ANN001
    import ray.data

    config = ProcessorConfig(
        engine=EngineConfig(dtype="float32", model=str(tiny_model_dir), max_num_seqs=16),
        sampling=SamplingParams(max_tokens=48, guided_decoding={"json": SCHEMA}),
        prompt_column="text",
        plan=PlanConfig(num_partitions=1),
        compute=ComputeConfig(num_cpus_per_actor=0.25),
    )
    ds = ray.data.from_items([{"text": p, "n": i} for i, p in enumerate(PROMPTS)])
    out = build_processor(config)(ds)
    assert out.schema().base_schema.field("parsed").type == pa.struct(
        [("label", pa.string()), ("score", pa.int64()), ("ok", pa.bool_())]
    )
    rows = out.take_all()
    assert sorted(r["n"] for r in rows) == list(range(len(PROMPTS)))
    for row in rows:
        assert row["error"] is None and row["finish_reason"] == "stop", row
        value = json.loads(row["generated_text"])
        jsonschema.validate(value, SCHEMA)
        assert row["parsed"] == value
