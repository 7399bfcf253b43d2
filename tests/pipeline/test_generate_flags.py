"""jobs/generate.py's flags end to end on a local Ray, checked from first principles: the
tokens equal Hugging Face `generate` on each prompt alone (through the tokenizer's chat
template with --chat), and the planner flags show in the output's shard and group columns."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.job.run import run_job
from tests.actors.reference import hf_greedy, torch_threads
from tests.pipeline.test_job import load_job, read_output

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DOCS = {
    "tea": "Green tea is made from leaves that are steamed or pan fired soon after picking, "
    "which keeps them from oxidising.",
    "rail": "The first public railway to use only steam locomotives opened in 1830 between "
    "two industrial cities in England.",
}
QUERIES = ["Why?", "When?", "Who cares?"]
TEMPLATE = "{document}\n\nQ: {query}\nA:"
MAX_TOKENS = 3
BUDGET = 60  # prompt tokens per shard: one document's rows each (prefix counted once)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):  # noqa: ANN201
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return tokenizer, model


def rows() -> list[dict[str, str]]:
    return [
        {"id": f"{doc}-{q}", "document": text, "query": query}
        for doc, text in DOCS.items()
        for q, query in enumerate(QUERIES)
    ]


def generate(tiny_model_dir: Path, input_path: Path, output: Path, *flags: str) -> None:
    """jobs/generate.py's parser and config, run on the test's Ray (one engine actor)."""
    job = load_job("generate")
    args = job.build_parser().parse_args(
        [
            "--input", str(input_path), "--output", str(output), "--model", str(tiny_model_dir), "--dtype", "float32",
            "--max-tokens", str(MAX_TOKENS), "--num-cpus-per-actor", "0.25",
            "--actor-resource", "fake_gpu=1", "--num-partitions", "1", *flags,
        ]
    )  # fmt: skip
    run_job(job.build_config(args))


def test_chat_from_a_jsonl_named_otherwise(ray_cluster, tiny_model_dir, tmp_path, reference):  # noqa: ANN001
    """--input-format jsonl reads a .txt file; --chat --system-prompt renders each prompt as
    [system, user] through the tokenizer's chat template."""
    tokenizer, model = reference
    data = tmp_path / "rows.txt"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    generate(
        tiny_model_dir, data, tmp_path / "out",
        "--input-format", "jsonl", "--template", TEMPLATE, "--chat",
        "--system-prompt", "You are terse.",
    )  # fmt: skip
    out = read_output(tmp_path / "out")
    assert set(out) == {r["id"] for r in rows()}
    with torch_threads(1):
        for row in rows():
            messages = [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": TEMPLATE.format(**row)},
            ]
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
            got = out[row["id"]]
            assert got["error"] is None, got["error"]
            assert got["num_prompt_tokens"] == len(ids)
            assert got["generated_token_ids"] == hf_greedy(model, ids, MAX_TOKENS), row["id"]


def test_prefix_key_tokens_shard_budget_no_nested(ray_cluster, tiny_model_dir, tmp_path, reference):  # noqa: ANN001
    """--prefix-key-tokens 16 groups rows that share under 64 tokens (with the default 64
    they have no prefix key and are never grouped); --max-tokens-per-shard splits the
    documents into shards within the budget; --no-nested-groups runs with only first-level
    groups; the tokens stay Hugging Face's."""
    tokenizer, model = reference
    table = rows()
    prompts = {
        r["id"]: tokenizer.encode(TEMPLATE.format(**r), add_special_tokens=False) for r in table
    }
    assert max(len(p) for p in prompts.values()) < 64  # precondition: no key with the default
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(table), path)
    generate(
        tiny_model_dir, path, tmp_path / "out",
        "--template", TEMPLATE, "--prefix-key-tokens", "16",
        "--max-tokens-per-shard", str(BUDGET), "--no-nested-groups",
        "--keep-columns", "document",
    )  # fmt: skip
    out = read_output(tmp_path / "out")
    assert set(out) == set(prompts)
    by_doc: dict[str, list[dict]] = defaultdict(list)
    with torch_threads(1):
        for row_id, ids in prompts.items():
            got = out[row_id]
            assert got["generated_token_ids"] == hf_greedy(model, ids, MAX_TOKENS), row_id
            by_doc[got["document"]].append(got)
    for members in by_doc.values():  # each document's rows: one group, its prefix shared
        assert len({m["prefix_group"] for m in members}) == 1
        assert all(m["shared_prefix_len"] >= 16 for m in members)
    shards: dict[str, list[dict]] = defaultdict(list)
    for got in out.values():
        shards[got["shard"]].append(got)
    assert len(shards) >= 2
    for members in shards.values():
        groups: dict[str, list[dict]] = defaultdict(list)
        for m in members:
            groups[m["prefix_group"]].append(m)
        tokens = sum(m["num_prompt_tokens"] for m in members) - sum(
            (len(g) - 1) * g[0]["shared_prefix_len"] for g in groups.values()
        )
        assert tokens <= BUDGET, (tokens, [m["id"] for m in members])
