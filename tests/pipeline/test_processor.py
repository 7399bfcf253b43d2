"""The processor inside a user's own Ray Data program (issue 14 item 1): every input column
comes back once per row, unchanged; the tokens equal LLMEngine.generate's and Hugging Face
`generate`'s; a bad row is an error row, never a failed dataset, and `retry_errors` runs it
again once fixed."""

from __future__ import annotations

import datetime
import json
from collections import Counter
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors import EngineConfig, LLMEngine, SamplingParams
from pipeline import ProcessorConfig, build_processor
from pipeline.config import ComputeConfig, PlanConfig, PromptConfig
from tests.actors.reference import assert_greedy_match, hf_greedy, torch_threads
from tests.pipeline.data import MALFORMED, TEMPLATE, rows
from tests.pipeline.user_maps import KEPT, fix_ids, no_error, with_query_len
from tests.tiny_models import VOCAB

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
DEFAULT_MAX_TOKENS = 4
GENERATED = {
    "generated_text",
    "generated_token_ids",
    "num_prompt_tokens",
    "num_generated_tokens",
    "finish_reason",
    "error",
}


def config(model_dir: Path, **kwargs) -> ProcessorConfig:
    """The tiny model on a fractional CPU, two shuffle partitions."""
    sampling = kwargs.pop("sampling", SamplingParams(max_tokens=DEFAULT_MAX_TOKENS))
    return ProcessorConfig(
        engine=EngineConfig(dtype="float32", model=str(model_dir), max_num_seqs=64),
        sampling=sampling,
        plan=PlanConfig(num_partitions=2),
        compute=ComputeConfig(num_cpus_per_actor=0.25),
        **kwargs,
    )


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    """The tiny model's tokenizer, its HF model and a raypack engine, for the references."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(dtype="float32", model=str(tiny_model_dir), max_num_seqs=64))
    return tokenizer, model, engine


def test_user_program_carries_every_column_once_and_equals_generate(
    ray_cluster, tiny_model_dir, references, tmp_path
):
    import ray.data

    tokenizer, model, engine = references
    # The user's table: the job tests' prompt rows (documents sharing long prefixes, bad rows)
    # plus columns of other types, a row repeated twice, and a timestamp with a time zone.
    table_rows = rows()
    for n, row in enumerate(table_rows):
        row["n"] = n
        row["tags"] = [n, n * 2] if n % 3 else []
        row["meta"] = {"doc": row["doc_id"], "weight": n / 4}
        row["when"] = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc) + (
            datetime.timedelta(minutes=n)
        )
    table_rows.append(dict(table_rows[0]))
    pq.write_table(pa.Table.from_pylist(table_rows), tmp_path / "in.parquet")

    ds = ray.data.read_parquet(str(tmp_path / "in.parquet"))
    ds = ds.map(with_query_len)  # the user's own step before
    expected = ds.take_all()  # what the processor gets
    ds.write_parquet(str(tmp_path / "given"))  # ... and its types, as Parquet stores them
    processor = build_processor(
        config(
            tiny_model_dir,
            prompt_template=TEMPLATE,
            override_columns=("max_tokens",),
            sampling_column="sampling",
        )
    )
    processor(ds).write_parquet(str(tmp_path / "out"))  # the user's own sink after
    out = pq.read_table(tmp_path / "out")

    # Every input column, in the order the dataset had them and with its type, then ours.
    schema_in = pq.read_table(tmp_path / "given").schema
    assert out.schema.names[: len(schema_in)] == schema_in.names
    for f in schema_in:
        assert out.schema.field(f.name).type == f.type, f.name
    # A sampling column may ask several samples of a row: a sample_index says which.
    assert set(out.schema.names[len(schema_in) :]) == GENERATED | {"sample_index"}
    got = out.to_pylist()
    assert len(got) == len(expected) == len(table_rows)
    carried = [{k: r[k] for k in schema_in.names} for r in got]
    assert Counter(_key(r) for r in carried) == Counter(_key(r) for r in expected)
    assert Counter(r["n"] for r in got)[0] == 2  # the repeated row: both copies generated

    errors = {r["id"]: r["error"] for r in got if r["error"] is not None}
    assert set(errors) == MALFORMED
    assert "'document' is null" in errors["null-doc"]
    assert "context of 512" in errors["long-doc"]
    assert "unknown sampling override" in errors["unknown-override"]
    assert "max_tokens" in errors["bad-override"] and "-1" in errors["bad-override"]
    assert all(r["finish_reason"] == "error" for r in got if r["id"] in MALFORMED)

    valid = [r for r in got if r["id"] not in MALFORMED]
    prompts = [TEMPLATE.format(**r) for r in valid]
    params = [SamplingParams(max_tokens=r["max_tokens"] or DEFAULT_MAX_TOKENS) for r in valid]
    with torch_threads(1):
        alone = engine.generate(prompts, params)
        special = PromptConfig(template=TEMPLATE).add_special_tokens
        for row, prompt, ref in zip(valid, prompts, alone, strict=True):
            assert row["generated_token_ids"] == list(ref.token_ids), row["id"]
            assert row["generated_text"] == ref.text
            ids = tokenizer(prompt, add_special_tokens=special)["input_ids"]
            assert row["num_prompt_tokens"] == len(ids)
            hf = hf_greedy(model, ids, row["max_tokens"] or DEFAULT_MAX_TOKENS)
            assert_greedy_match(model, ids, row["generated_token_ids"], hf)
            assert row["num_generated_tokens"] == len(row["generated_token_ids"])


def test_token_ids_with_logprobs_filtered_after(ray_cluster, tiny_model_dir, references, tmp_path):
    import ray.data

    tokenizer, model, engine = references
    docs = [r for r in rows() if r["id"] not in MALFORMED][:10]
    prompts = [tokenizer.encode(TEMPLATE.format(**r), add_special_tokens=False) for r in docs]
    items = [{"k": i, "ids": ids} for i, ids in enumerate(prompts)]
    bad = {
        100: (None, "is null"),
        101: ([], "is empty"),
        102: ([5, VOCAB + 7, 3], f"token id {VOCAB + 7} at position 1 is outside"),
        103: (list(range(600)), "context of 512"),
    }
    items += [{"k": k, "ids": ids} for k, (ids, _) in bad.items()]
    ds = ray.data.from_items(items)
    sampling = SamplingParams(max_tokens=DEFAULT_MAX_TOKENS, logprobs=2)
    processor = build_processor(
        config(tiny_model_dir, token_ids_column="ids", sampling=sampling, concurrency=1)
    )
    done = processor(ds).materialize()
    ok = done.filter(no_error).take_all()  # the user's own filter after
    failed = {r["k"]: r for r in done.take_all() if r["error"] is not None}

    assert sorted(r["k"] for r in ok) == list(range(len(prompts)))
    assert set(failed) == set(bad)
    for k, (_, message) in bad.items():
        assert message in failed[k]["error"], failed[k]["error"]
        assert failed[k]["finish_reason"] == "error" and failed[k]["logprobs"] is None
    with torch_threads(1):
        alone = engine.generate(prompts, SamplingParams(max_tokens=DEFAULT_MAX_TOKENS))
        for row in ok:
            ids = prompts[row["k"]]
            assert list(row["ids"]) == ids and row["num_prompt_tokens"] == len(ids)
            assert row["generated_token_ids"] == list(alone[row["k"]].token_ids)
            hf = hf_greedy(model, ids, DEFAULT_MAX_TOKENS)
            assert_greedy_match(model, ids, row["generated_token_ids"], hf)
            # Each token's logprob is log_softmax of Hugging Face's logits at its position.
            lps = row["logprobs"]
            assert [lp["token_id"] for lp in lps] == row["generated_token_ids"]
            full = torch.tensor([ids + row["generated_token_ids"]])
            with torch.inference_mode():
                logits = model(full).logits[0, len(ids) - 1 : -1].float()
            want = torch.log_softmax(logits, -1)
            for pos, lp in enumerate(lps):
                assert abs(lp["logprob"] - float(want[pos, lp["token_id"]])) < 1e-4
                assert lp["top"][0]["token_id"] == lp["token_id"] and len(lp["top"]) == 2

    # The user's retry (`Processor.retry_errors`, one sample per row): the error rows' ids
    # fixed, every other row kept as it is (its text marked: a regenerated row would show);
    # only the fixed rows run again and every row comes back once. The fix is lazy, as a
    # user's map is: it runs once (a retry that read its input twice, once for the rows kept
    # and once for those retried, could keep a row and retry it too when the input is not
    # the same both times). (Its run on rows of several samples: test_processor_retry.py.)
    fixes = {k: prompts[n] for n, k in enumerate(sorted(bad))}
    seen = tmp_path / "fixed"
    retried = processor.retry_errors(
        done.map_batches(partial(fix_ids, fixes, seen), batch_format="pyarrow")
    ).take_all()
    assert sorted(map(int, seen.read_text().split())) == sorted(r["k"] for r in done.take_all())
    assert sorted(r["k"] for r in retried) == [*range(len(prompts)), *sorted(bad)]
    by_k = {r["k"]: r for r in retried}
    assert all(by_k[k]["generated_text"] == KEPT for k in range(len(prompts)))  # not redone
    with torch_threads(1):
        redone = engine.generate(
            list(fixes.values()), SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)
        )
    for k, ref in zip(fixes, redone, strict=True):
        assert by_k[k]["error"] is None, by_k[k]
        assert list(by_k[k]["generated_token_ids"]) == list(ref.token_ids), k
        assert [lp["token_id"] for lp in by_k[k]["logprobs"]] == list(ref.token_ids)
    # Nothing left to retry: the rows come back as they are (and no actor starts).
    from ray._private.state import actors

    started = set(actors())
    again = processor.retry_errors(ray.data.from_items(retried)).take_all()
    assert set(actors()) == started
    assert sorted(r["k"] for r in again) == sorted(by_k)
    assert not any(r["error"] for r in again)


def test_bad_configs_fail_before_any_work(ray_cluster, tiny_model_dir):
    import ray.data

    with pytest.raises(ValueError, match="exactly one of"):
        ProcessorConfig(prompt_column="p", token_ids_column="ids")
    with pytest.raises(ValueError, match="not SamplingParams fields"):
        ProcessorConfig(prompt_column="p", override_columns=("temp",))
    ds = ray.data.from_items([{"text": "hi", "error": "theirs"}])
    with pytest.raises(ValueError, match=r"no column 'p' .*Its columns"):
        build_processor(config(tiny_model_dir, prompt_column="p"))(ds)
    with pytest.raises(ValueError, match=r"\['error'\] have the names"):
        build_processor(config(tiny_model_dir, prompt_column="text"))(ds)


def _key(row: dict) -> str:
    return json.dumps(row, sort_keys=True, default=str)
