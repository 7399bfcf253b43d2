"""End-to-end benchmark of the offline job: prefix grouping on vs off, SmolLM2 on CPU.

    python jobs/bench_pipeline.py --json

Two workloads, each run through the whole pipeline (read, tokenize, shuffle, plan, engine
actor, Parquet) in these modes (`--modes`):
- on: prefix grouping (shuffle by prefix key, groups, shards), the engine's block-hash
  prefix cache on;
- off: `--no-prefix-grouping` (no shuffle, every row alone), the engine's cache still on (as
  vLLM's automatic prefix caching would be): it finds what rows in the same shard share;
- off-nocache: no grouping and no engine cache: every prompt token computed.

(a) HH-RLHF harmless-base test (../shared/data): each dialogue's `chosen` and `rejected`
    transcripts are two rows that share the whole conversation; a subsample of dialogues.
(b) Synthetic snippets: documents of about 1,000 tokens (Python docstrings, cut), each with
    16 queries of about 50 tokens, through jobs/snippets.py's chat prompt.

Rows are shuffled (fixed seed) so rows sharing a prefix are not neighbours, as in a real
query log. Reported per run: end-to-end wall time (actor start-up included), rows/s,
generated tokens/s, and the prefix saving ratio (prompt tokens the plan computes once instead
of per row / all prompt tokens) against the dataset's optimum (every distinct prefix once:
packing.optimal_saving_ratio) and the best any one-level grouping can do
(packing.prefix.one_level_optimal_saving_ratio). Single runs on a shared 2-core box swing a
lot; read the ratios.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import random
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from actors.config import EngineConfig, SamplingParams  # noqa: E402
from pipeline.config import (  # noqa: E402
    ComputeConfig,
    InputConfig,
    JobConfig,
    PlanConfig,
    PromptConfig,
)

ROOT = Path(__file__).parents[1]
# mode -> (prefix grouping in the plan, the engine's block-hash prefix cache)
MODES = {
    "on": (True, True),
    "off": (False, True),
    "off-nocache": (False, False),
    "on-nocache": (True, False),
}
HH = ROOT.parent / "shared" / "data" / "hh_rlhf_harmless_base_test.jsonl.gz"
DOC_MODULES = [
    "json", "statistics", "configparser", "re", "sys", "wave", "turtle", "site", "shelve",
    "uuid", "hashlib", "socket", "csv", "argparse", "heapq", "itertools", "copy", "unittest",
    "doctest", "timeit", "urllib.parse", "http.client", "plistlib", "subprocess", "io", "os",
    "struct", "sched", "inspect", "typing", "sqlite3", "ftplib", "smtplib", "tempfile",
]  # fmt: skip


def hh_rows(num_dialogues: int, max_tokens: int, tokenizer, seed: int) -> list[dict]:  # noqa: ANN001
    """Two rows per dialogue (chosen, rejected), dialogues whose transcripts fit max_tokens."""
    rows: list[dict] = []
    with gzip.open(HH, "rt", encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            record = json.loads(line)
            texts = [record["chosen"], record["rejected"]]
            if any(len(tokenizer(t)["input_ids"]) > max_tokens for t in texts):
                continue
            rows += [{"id": f"{i}-{k}", "text": t} for k, t in zip(("c", "r"), texts, strict=True)]
            if len(rows) >= 2 * num_dialogues:
                break
    random.Random(seed).shuffle(rows)
    return rows


def snippet_rows(
    num_docs: int,
    share: int,
    doc_tokens: int,
    query_tokens: int,
    tokenizer,
    seed: int,  # noqa: ANN001
) -> list[dict]:
    """`num_docs` documents of `doc_tokens` tokens, each with `share` queries of
    `query_tokens` tokens: consecutive pieces of Python docstrings, none shared."""
    import importlib
    import inspect

    pool: list[int] = []
    for name in DOC_MODULES:
        doc = inspect.cleandoc(importlib.import_module(name).__doc__ or "")
        pool += tokenizer(doc + "\n\n")["input_ids"]
    need = num_docs * (doc_tokens + share * query_tokens)
    if len(pool) < need:
        raise ValueError(f"the docstrings give {len(pool)} tokens, {need} needed; ask for less")
    rows = []
    at = 0
    for d in range(num_docs):
        document = tokenizer.decode(pool[at : at + doc_tokens])
        at += doc_tokens
        for q in range(share):
            query = tokenizer.decode(pool[at : at + query_tokens])
            at += query_tokens
            rows.append({"id": f"d{d}-q{q}", "document": document, "query": query})
    random.Random(seed).shuffle(rows)
    return rows


def run_pair(name: str, table: list[dict], prompt: PromptConfig, args, workdir: Path) -> dict:  # noqa: ANN001
    """Both configurations on one table; their summaries and the dataset's optimum."""
    from packing import optimal_saving_ratio
    from packing.prefix import one_level_optimal_saving_ratio
    from pipeline.job import prepare, run_job
    from pipeline.tokenize import TokenizeStage

    path = workdir / f"{name}.parquet"
    pq.write_table(pa.Table.from_pylist(table), path)
    base = JobConfig(
        input=InputConfig(str(path)),
        prompt=prompt,
        output=str(workdir / f"{name}-out"),
        engine=EngineConfig(model=args.model, kv_cache_memory_gb=args.kv_cache_memory_gb),
        sampling=SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
        plan=PlanConfig(key_block_size=args.key_tokens, max_rows_per_shard=args.max_rows_per_shard),
        compute=ComputeConfig(num_actors=1),
    )
    # The same tokens the pipeline sees, for the optimum.
    prepared = prepare(base)
    tokenize = TokenizeStage(
        prompt, model=args.model, max_model_len=prepared.max_model_len, sampling=base.sampling
    )
    batch = pa.Table.from_pylist(table)
    tokens = [t for t, e in zip(*_columns(tokenize(batch)), strict=True) if e is None]
    result: dict = {
        "rows": len(table),
        "prompt_tokens": sum(len(t) for t in tokens),
        "optimal_saving_ratio": round(optimal_saving_ratio(tokens), 5),
        "one_level_optimal_saving_ratio": round(one_level_optimal_saving_ratio(tokens), 5),
        "runs": {},
    }
    for mode in args.modes:
        grouping, cache = MODES[mode]
        config = replace(
            base,
            output=str(workdir / f"{name}-{mode}"),
            plan=replace(base.plan, prefix_grouping=grouping),
            engine=replace(base.engine, enable_prefix_caching=cache),
        )
        summary = run_job(config)
        result["runs"][mode] = {
            "wall_s": summary.wall_time_s,
            "rows_per_s": summary.rows_per_s,
            "generated_tokens_per_s": summary.generated_tokens_per_s,
            "generated_tokens": summary.generated_tokens,
            "errors": summary.error_rows,
            "prefix_saving_ratio": summary.prefix_saving_ratio,
            "engine_cached_ratio": round(
                summary.cached_prompt_tokens / max(summary.prompt_tokens, 1), 5
            ),
            "shared_groups": summary.num_shared_groups,
        }
    on = result["runs"].get("on")
    for baseline in ("off", "off-nocache"):
        if on and baseline in result["runs"]:
            speedup = result["runs"][baseline]["wall_s"] / on["wall_s"]
            result[f"speedup_vs_{baseline}"] = round(speedup, 3)
    if on:
        planned = on["prefix_saving_ratio"]
        result["saving_vs_optimum"] = round(planned / result["optimal_saving_ratio"], 4)
        result["saving_vs_one_level_optimum"] = round(
            planned / result["one_level_optimal_saving_ratio"], 4
        )
    return result


def _columns(table: pa.Table) -> tuple[list, list]:
    return table.column("prompt_token_ids").to_pylist(), table.column("error").to_pylist()


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the results (JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--hh-dialogues", type=int, default=60)
    parser.add_argument("--hh-max-prompt-tokens", type=int, default=400)
    parser.add_argument("--snippet-docs", type=int, default=4)
    parser.add_argument("--share-degree", type=int, default=16)
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--query-tokens", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--key-tokens", type=int, default=16, help="prefix key tokens (PlanConfig.key_block_size)"
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["off", "on", "off-nocache"],
        choices=list(MODES),
        help="run order; 'nocache' also turns off the engine's block-hash prefix cache",
    )
    parser.add_argument("--only", choices=["hh", "snippets"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=1.0,
        help="the engine's KV pool; shrink it with the data to see a cache that cannot hold "
        "every document, as at production scale",
    )
    parser.add_argument("--max-rows-per-shard", type=int, default=256)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from actors.loader import load_tokenizer
    from pipeline.cli import connect_ray

    sys.path.insert(0, str(ROOT / "jobs"))
    from snippets import snippet_prompt

    tokenizer = load_tokenizer(args.model)
    connect_ray()
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    out: dict = {
        "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "max_rows_per_shard": args.max_rows_per_shard,
        "model": args.model,
        "cpus": os.cpu_count(),
        "max_tokens": args.max_tokens,
        "key_tokens": args.key_tokens,
    }
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        workdir = Path(tmp)
        if args.only in (None, "hh"):
            table = hh_rows(args.hh_dialogues, args.hh_max_prompt_tokens, tokenizer, args.seed)
            out["hh_rlhf"] = run_pair(
                "hh", table, PromptConfig(prompt_column="text"), args, workdir
            )
        if args.only in (None, "snippets"):
            table = snippet_rows(
                args.snippet_docs,
                args.share_degree,
                args.doc_tokens,
                args.query_tokens,
                tokenizer,
                args.seed,
            )
            out["snippets_share16"] = run_pair(
                "snippets", table, snippet_prompt("document", "query"), args, workdir
            )
    bars = {}
    for name in ("hh_rlhf", "snippets_share16"):
        if name in out and "saving_vs_optimum" in out[name]:
            bars[f"{name}: saving >= 99% of optimum"] = out[name]["saving_vs_optimum"] >= 0.99
            bars[f"{name}: saving >= 99% of one-level optimum"] = (
                out[name]["saving_vs_one_level_optimum"] >= 0.99
            )
    for baseline in ("off", "off-nocache"):
        speedup = out.get("snippets_share16", {}).get(f"speedup_vs_{baseline}")
        if speedup is not None:
            bars[f"snippets_share16: >= 1.5x faster with grouping than {baseline}"] = speedup >= 1.5
    out["bars"] = bars
    print(json.dumps(out, indent=2) if args.json else _table(out))
    return 0


def _table(out: dict) -> str:
    lines = []
    for name in ("hh_rlhf", "snippets_share16"):
        if name not in out:
            continue
        r = out[name]
        lines.append(
            f"{name}: {r['rows']} rows, optimum {r['optimal_saving_ratio']:.1%}, one-level {r['one_level_optimal_saving_ratio']:.1%}"
        )
        for mode, run in r["runs"].items():
            lines.append(
                f"  {mode:11}: {run['wall_s']:.1f}s, {run['rows_per_s']:.2f} rows/s, "
                f"{run['generated_tokens_per_s']:.1f} gen tok/s, saving {run['prefix_saving_ratio']:.1%}"
            )
        lines += [f"  {k} {v:.2f}x" for k, v in r.items() if k.startswith("speedup_vs_")]
    lines += [f"{k}: {'met' if v else 'NOT met'}" for k, v in out["bars"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
