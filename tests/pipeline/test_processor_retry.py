"""The processor's error retry (issue 14 item 4, `Processor.retry_errors`): rows that ended with
an error run again once their input is fixed, every other row passes through untouched (not
regenerated), every row comes back once, and the retried tokens equal the engine's. Here on
rows of several samples; on rows of one: test_processor.py's token-ids run, retried."""

from __future__ import annotations

from dataclasses import replace

import pyarrow as pa
import pytest

from actors import EngineConfig, SamplingParams
from pipeline import ProcessorConfig, build_processor
from pipeline.config import ComputeConfig, PlanConfig, PromptConfig
from tests.pipeline.test_retry_errors import BAD, PROMPTS
from tests.pipeline.user_maps import KEPT, fix_samples

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Samples per row in the samples test: the processor's n=2, and ok-3's own through its
# sampling column.
SAMPLES = {d: 3 if d == "ok-3" else 2 for d in PROMPTS}


def prompt_rows():
    """The prompts as a dataset; the BAD rows' max_tokens -1 makes them error rows; ok-3's
    `sampling` asks 3 samples (read only by a processor with that sampling column)."""
    import ray.data

    ids = list(PROMPTS)
    return ray.data.from_arrow(
        pa.table(
            {
                "doc": ids,
                "prompt": list(PROMPTS.values()),
                "max_tokens": pa.array([-1 if i in BAD else None for i in ids], pa.int64()),
                "sampling": [f'{{"n": {SAMPLES[i]}}}' if i == "ok-3" else None for i in ids],
            }
        )
    )


def test_retry_errors_with_samples_each_row_sample_once(ray_cluster, tiny_model_dir):
    """n=2 (the processor's), and n=3 for one row through the sampling column: a row's
    samples are output rows of their own, greedy ones equal to Hugging Face `generate`; a row
    with an error in one sample runs again with all, its good samples dropped; every (doc,
    sample_index) comes back exactly once."""
    import ray.data
    import torch
    from transformers import AutoModelForCausalLM

    from actors.loader import load_tokenizer
    from tests.actors.reference import hf_greedy, torch_threads

    ids = list(PROMPTS)
    ds = prompt_rows()
    config = ProcessorConfig(
        engine=EngineConfig(dtype="float32", model=str(tiny_model_dir), max_num_seqs=16),
        sampling=SamplingParams(max_tokens=3, n=2),
        prompt_column="prompt",
        id_column="doc",
        override_columns=("max_tokens",),
        sampling_column="sampling",
        plan=PlanConfig(num_partitions=1),
        compute=ComputeConfig(num_cpus_per_actor=0.25),
    )
    processor = build_processor(config)
    first = processor(ds).materialize()
    rows = first.take_all()
    assert sorted((r["doc"], r["sample_index"]) for r in rows if r["error"]) == [
        (d, 0) for d in sorted(BAD)
    ]  # an error before the engine: one row
    good = sorted((r["doc"], r["sample_index"]) for r in rows if not r["error"])
    assert good == [(d, s) for d in sorted(set(ids) - BAD) for s in range(SAMPLES[d])]
    tokenizer = load_tokenizer(str(tiny_model_dir))
    special = PromptConfig(prompt_column="prompt").add_special_tokens
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch_threads(1):
        hf = {
            d: hf_greedy(model, tokenizer(PROMPTS[d], add_special_tokens=special)["input_ids"], 3)
            for d in ids
        }
    for r in rows:
        if not r["error"]:
            assert list(r["generated_token_ids"]) == hf[r["doc"]], r

    retried = processor.retry_errors(first.map_batches(fix_samples, batch_format="pyarrow"))
    retried = retried.take_all()
    assert sorted((r["doc"], r["sample_index"]) for r in retried) == sorted(
        (d, s) for d in ids for s in range(SAMPLES[d])
    )
    assert not any(r["error"] for r in retried)
    redone = BAD | {"ok-1"}
    for r in retried:
        assert (r["generated_text"] == KEPT) == (r["doc"] not in redone), r
        assert list(r["generated_token_ids"]) == hf[r["doc"]] or r["doc"] not in redone, r

    # An error row without an id: refused, not merged with other null-id rows.
    nameless = [{**r, "doc": None} if r["doc"] == "bad-1" else r for r in rows]
    with pytest.raises(ValueError, match=r"rows with an error have a null 'doc'"):
        processor.retry_errors(ray.data.from_items(nameless))

    without_id = build_processor(replace(config, id_column=None))
    with pytest.raises(ValueError, match=r"needs the processor's id_column"):
        without_id.retry_errors(first)


def test_retry_errors_needs_a_processor_output(ray_cluster, tiny_model_dir):
    import ray.data

    processor = build_processor(
        ProcessorConfig(
            engine=EngineConfig(dtype="float32", model=str(tiny_model_dir)), prompt_column="prompt"
        )
    )
    with pytest.raises(ValueError, match=r"retry_errors takes a dataset this processor returned"):
        processor.retry_errors(ray.data.from_items([{"prompt": "hi"}]))
