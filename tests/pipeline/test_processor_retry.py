"""The processor's error retry (issue 14 item 4, `Processor.retry_errors`): rows that ended with
an error run again once their input is fixed, every other row passes through untouched (not
regenerated), every row comes back once, and the retried tokens equal the engine's."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from actors import EngineConfig, LLMEngine, SamplingParams
from pipeline import ProcessorConfig, build_processor
from pipeline.config import ComputeConfig, PlanConfig
from tests.pipeline.test_retry_errors import BAD, PROMPTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KEPT = "kept from the first run"


def _fix(batch: pa.Table) -> pa.Table:
    """The user's fix: the out-of-range per-row max_tokens cleared; the first run's text of
    the good rows marked, so a regenerated good row would show."""
    ok = pc.is_null(batch.column("error"))
    text = pc.if_else(ok, pa.scalar(KEPT), batch.column("generated_text"))
    batch = batch.set_column(batch.schema.get_field_index("generated_text"), "generated_text", text)
    cleared = pa.nulls(batch.num_rows, batch.schema.field("max_tokens").type)
    return batch.set_column(batch.schema.get_field_index("max_tokens"), "max_tokens", cleared)


def test_retry_errors_reruns_only_the_error_rows(ray_cluster, tiny_model_dir):
    import ray.data

    ids = list(PROMPTS)
    ds = ray.data.from_arrow(
        pa.table(
            {
                "doc": ids,
                "prompt": list(PROMPTS.values()),
                "max_tokens": pa.array([-1 if i in BAD else None for i in ids], pa.int64()),
            }
        )
    )
    processor = build_processor(
        ProcessorConfig(
            engine=EngineConfig(dtype="float32", model=str(tiny_model_dir), max_num_seqs=16),
            sampling=SamplingParams(max_tokens=3),
            prompt_column="prompt",
            override_columns=("max_tokens",),
            plan=PlanConfig(num_partitions=1),
            compute=ComputeConfig(num_cpus_per_actor=0.25),
        )
    )
    first = processor(ds).materialize()
    errors = {r["doc"]: r["error"] for r in first.take_all()}
    assert {d for d, e in errors.items() if e} == BAD, errors
    assert all("max_tokens" in errors[d] for d in BAD), errors

    retried = processor.retry_errors(first.map_batches(_fix, batch_format="pyarrow")).take_all()
    assert sorted(r["doc"] for r in retried) == sorted(ids)  # every row once
    by_doc = {r["doc"]: r for r in retried}
    assert all(by_doc[d]["generated_text"] == KEPT for d in ids if d not in BAD)  # not redone
    engine = LLMEngine(EngineConfig(dtype="float32", model=str(tiny_model_dir), max_num_seqs=16))
    expected = engine.generate([PROMPTS[d] for d in sorted(BAD)], SamplingParams(max_tokens=3))
    for doc, out in zip(sorted(BAD), expected, strict=True):
        assert by_doc[doc]["error"] is None, by_doc[doc]
        assert list(by_doc[doc]["generated_token_ids"]) == list(out.token_ids), doc

    # Nothing left to retry: the rows come back as they are.
    again = processor.retry_errors(ray.data.from_items(retried)).take_all()
    assert sorted(r["doc"] for r in again) == sorted(ids)
    assert not any(r["error"] for r in again)


def test_retry_errors_needs_a_processor_output(ray_cluster, tiny_model_dir):
    import ray.data

    processor = build_processor(
        ProcessorConfig(
            engine=EngineConfig(dtype="float32", model=str(tiny_model_dir)), prompt_column="prompt"
        )
    )
    with pytest.raises(ValueError, match=r"retry_errors takes a dataset this processor returned"):
        processor.retry_errors(ray.data.from_items([{"prompt": "hi"}]))
