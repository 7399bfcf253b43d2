"""End-to-end benchmark of the offline job: prefix grouping on vs off, SmolLM2 on CPU.

    python benchmarks/bench_pipeline.py --json

Each configuration runs the whole pipeline (read, tokenize, shuffle, plan, engine actors,
Parquet) in these modes (`--modes`):
- on: prefix grouping (shuffle by prefix key, groups, shards), the engine's block-hash
  prefix cache on;
- off: `--no-prefix-grouping` (no shuffle, every row alone), the engine's cache still on (as
  vLLM's automatic prefix caching would be): it finds what rows run close together share;
- off-nocache: no grouping and no engine cache: every prompt token computed.

Configurations (`--configs`):
- snippets_share16 (the bar): synthetic snippets, documents of about 1,000 tokens (Python
  docstrings, cut), each with 16 queries of about 50 tokens, through jobs/snippets.py's chat
  prompt, in the regime BatchLLM's global grouping is for, scaled down to a CPU. At
  production scale (millions of rows, many data-parallel engine actors, far more distinct
  documents than one actor's KV pool holds) the rows of one document, without global
  grouping, land in several shards on several actors at different times: each actor
  computes the document again, and automatic prefix caching has evicted it before its next
  query comes. Here: `--docs` documents, `--num-actors` engine actors (each a fraction of a
  CPU and its own torch thread, as several GPUs would be), shards of `--max-rows-per-shard`
  rows, and a per-actor KV pool of `--pool-docs` documents' prompts, so a pool holds a
  fraction of the documents each actor sees (the JSON states both), as a GPU's pool holds a
  fraction of a production corpus.
- snippets_share16_fits: the same rows for `--fits-docs` documents on one engine actor
  whose 1 GB pool holds every document, all rows in one shard: the engine's block cache
  finds every shared document by itself, so grouping can only win the few steps it saves,
  against the cost of the shuffle. Not the production regime; reported for honesty.
- hh_rlhf: the HH-RLHF harmless-base test file (../shared/data): each dialogue's `chosen`
  and `rejected` transcripts are two rows sharing the conversation; one engine actor.

Rows are shuffled (fixed seed) so rows sharing a prefix are not neighbours, as in a query
log. Per run: wall time (actor start-up included), CPU seconds of the whole local Ray
(steadier than wall time on a shared box), rows/s, generated tokens/s, prompt tokens the
engines computed, and the plan's prefix saving ratio against the dataset's optimum (every
distinct prefix once: packing.optimal_saving_ratio) and the best one-level grouping.
`--repeats` runs the modes again in rotated order and reports medians.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from _pipeline_workloads import (  # noqa: E402
    ClusterCPU,
    hh_rows,
    output_measures,
    snippet_rows,
)

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
CONFIGS = ("snippets_share16", "snippets_share16_fits", "hh_rlhf")
RUN_FIELDS = (
    "wall_s",
    "cpu_s",
    "rows_per_s",
    "generated_tokens_per_s",
    "computed_prompt_tokens",
)


def run_config(
    name: str,
    table: list[dict],
    base: JobConfig,
    args,  # noqa: ANN001
    workdir: Path,
    pool_docs: float | None = None,
) -> dict:
    """Every mode (`--repeats` times, rotated) on one table; medians, speedups, the optimum.
    With `pool_docs`, each engine's KV pool holds that many mean prompts (in whole blocks)."""
    from packing import optimal_saving_ratio
    from packing.prefix import one_level_optimal_saving_ratio
    from pipeline.job.run import prepare
    from pipeline.stages.tokenize import TokenizeStage

    path = workdir / f"{name}.parquet"
    pq.write_table(pa.Table.from_pylist(table), path)
    base = replace(base, input=InputConfig(str(path)))
    # The same tokens the pipeline sees, for the optimum and the computed-token count.
    prepared = prepare(base)
    tokenize = TokenizeStage(
        base.prompt, model=args.model, max_model_len=prepared.max_model_len, sampling=base.sampling
    )
    tokenized = tokenize(pa.Table.from_pylist(table))
    tokens_by_id = {
        i: t
        for i, t, e in zip(
            *(tokenized.column(c).to_pylist() for c in ("id", "prompt_token_ids", "error")),
            strict=True,
        )
        if e is None
    }
    tokens = list(tokens_by_id.values())
    mean_prompt = sum(len(t) for t in tokens) / max(len(tokens), 1)
    if pool_docs is not None:
        blocks = math.ceil(pool_docs * mean_prompt / base.engine.block_size)
        base = replace(base, engine=replace(base.engine, num_kv_blocks=blocks))
    documents = name.startswith("snippets")
    result: dict = {
        "rows": len(table),
        "prompt_tokens": sum(len(t) for t in tokens),
        "mean_prompt_tokens": round(mean_prompt, 1),
        "optimal_saving_ratio": round(optimal_saving_ratio(tokens), 5),
        "one_level_optimal_saving_ratio": round(one_level_optimal_saving_ratio(tokens), 5),
        "num_actors": base.compute.num_actors,
        "max_rows_per_shard": base.plan.max_rows_per_shard,
        "kv_pool_tokens_per_actor": _pool_tokens(base.engine),
        "runs": {},
    }
    samples: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    for r in range(args.repeats):
        shift = r % len(args.modes)
        for mode in args.modes[shift:] + args.modes[:shift]:
            samples[mode].append(_run_mode(name, mode, base, prepared, tokens_by_id, workdir, r))
            logging.warning("%s %s #%d: %s", name, mode, r, json.dumps(samples[mode][-1]))
    for mode, runs in samples.items():
        median = {k: round(statistics.median(run[k] for run in runs), 3) for k in RUN_FIELDS}
        last = runs[-1]
        median.update({k: v for k, v in last.items() if k not in RUN_FIELDS})
        if len(runs) > 1:
            median["wall_s_each"] = [run["wall_s"] for run in runs]
            median["cpu_s_each"] = [run["cpu_s"] for run in runs]
        result["runs"][mode] = median
    if documents:
        result.update(_document_fractions(result, base, args))
    on = result["runs"].get("on")
    for baseline in ("off", "off-nocache"):
        if on and baseline in result["runs"]:
            off = result["runs"][baseline]
            result[f"speedup_vs_{baseline}"] = round(off["wall_s"] / on["wall_s"], 3)
            result[f"cpu_ratio_vs_{baseline}"] = round(off["cpu_s"] / on["cpu_s"], 3)
            result[f"computed_tokens_ratio_vs_{baseline}"] = round(
                off["computed_prompt_tokens"] / max(on["computed_prompt_tokens"], 1), 3
            )
    if on:
        planned = on["prefix_saving_ratio"]
        result["saving_vs_optimum"] = round(planned / result["optimal_saving_ratio"], 4)
        result["saving_vs_one_level_optimum"] = round(
            planned / result["one_level_optimal_saving_ratio"], 4
        )
    return result


def _run_mode(name, mode, base, prepared, tokens_by_id, workdir, repeat) -> dict:  # noqa: ANN001
    from pipeline.job.run import run_job

    grouping, cache = MODES[mode]
    config = replace(
        base,
        output=str(workdir / f"{name}-{mode}-{repeat}"),
        plan=replace(base.plan, prefix_grouping=grouping),
        engine=replace(base.engine, enable_prefix_caching=cache),
    )
    load = os.getloadavg()[0]
    cpu = ClusterCPU()
    cpu.start()
    started = time.perf_counter()
    summary = run_job(config, prepared=prepared)
    wall = time.perf_counter() - started
    cpu_s = cpu.stop()
    measures = output_measures(config.output, tokens_by_id, documents=name.startswith("snip"))
    return {
        "wall_s": round(summary.wall_time_s, 3),
        "cpu_s": round(cpu_s, 1),
        "rows_per_s": summary.rows_per_s,
        "generated_tokens_per_s": summary.generated_tokens_per_s,
        **measures,
        "generated_tokens": summary.generated_tokens,
        "errors": summary.error_rows,
        "prefix_saving_ratio": summary.prefix_saving_ratio,
        "engine_cached_ratio": round(
            summary.cached_prompt_tokens / max(summary.prompt_tokens, 1), 5
        ),
        "shared_groups": summary.num_shared_groups,
        "load_average_1m": [round(load, 2), round(os.getloadavg()[0], 2)],
        "driver_wall_s": round(wall, 3),
    }


def _pool_tokens(engine: EngineConfig) -> int | None:
    return engine.num_kv_blocks * engine.block_size if engine.num_kv_blocks else None


def _document_fractions(result: dict, base: JobConfig, args) -> dict:  # noqa: ANN001
    """How much of the documents an actor sees its KV pool holds, as at production scale."""
    docs = result["rows"] // args.share_degree
    actors = base.compute.num_actors
    pool = result["kv_pool_tokens_per_actor"]
    out: dict = {"documents": docs, "share_degree": args.share_degree}
    if pool:
        out["documents_per_pool"] = round(pool / result["mean_prompt_tokens"], 2)
    for mode, run in result["runs"].items():
        spread = run.get("shards_per_document", 1)
        # Shards go to whichever actor is free: at random, each actor gets a document's
        # shard with probability 1/actors.
        seen = docs * (1 - (1 - 1 / actors) ** spread)
        out[f"documents_per_actor_{mode}"] = round(seen, 2)
        if pool:
            # The share of an actor's documents its pool can hold at once.
            out[f"pool_fraction_of_actor_documents_{mode}"] = round(
                out["documents_per_pool"] / max(seen, 1e-9), 3
            )
    return out


def snippet_config(args, production: bool) -> JobConfig:  # noqa: ANN001
    """The snippet job's config: the production-scaled layout, or everything on one actor."""
    from snippets import snippet_prompt

    if production:
        engine = EngineConfig(model=args.model)  # the pool is sized in run_config
        compute = ComputeConfig(
            num_actors=args.num_actors, num_cpus_per_actor=args.num_cpus_per_actor
        )
        plan = PlanConfig(
            key_block_size=args.key_tokens, max_rows_per_shard=args.max_rows_per_shard
        )
    else:
        engine = EngineConfig(model=args.model, kv_cache_memory_gb=1.0)
        compute = ComputeConfig(num_actors=1)
        plan = PlanConfig(key_block_size=args.key_tokens, max_rows_per_shard=256)
    return JobConfig(
        input=InputConfig("-"),
        prompt=snippet_prompt("document", "query"),
        output="-",
        engine=engine,
        sampling=SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
        plan=plan,
        compute=compute,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the results (JSON with --json)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")

    from actors.loader import load_tokenizer
    from pipeline.commands.cli import connect_ray

    tokenizer = load_tokenizer(args.model)
    connect_ray()
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    out: dict = {
        "model": args.model,
        "cpus": os.cpu_count(),
        "max_tokens": args.max_tokens,
        "key_tokens": args.key_tokens,
        "repeats": args.repeats,
        "modes": args.modes,
    }
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        workdir = Path(tmp)
        for name in args.configs:
            if name == "hh_rlhf":
                table = hh_rows(args.hh_dialogues, args.hh_max_prompt_tokens, tokenizer, args.seed)
                base = JobConfig(
                    input=InputConfig("-"),
                    prompt=PromptConfig(prompt_column="text"),
                    output="-",
                    engine=EngineConfig(model=args.model, kv_cache_memory_gb=1.0),
                    sampling=SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
                    plan=PlanConfig(key_block_size=args.key_tokens),
                )
                out[name] = run_config(name, table, base, args, workdir)
                continue
            production = name == "snippets_share16"
            docs = args.docs if production else args.fits_docs
            table = snippet_rows(
                docs, args.share_degree, args.doc_tokens, args.query_tokens, tokenizer, args.seed
            )
            pool_docs = args.pool_docs if production else None
            base = snippet_config(args, production)
            out[name] = run_config(name, table, base, args, workdir, pool_docs)
    out["bars"] = _bars(out)
    out["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out, indent=2) if args.json else _table(out))
    return 0


def _bars(out: dict) -> dict:
    bars = {}
    for name in ("hh_rlhf", "snippets_share16"):
        if name in out and "saving_vs_optimum" in out[name]:
            bars[f"{name}: saving >= 99% of optimum"] = out[name]["saving_vs_optimum"] >= 0.99
    speedup = out.get("snippets_share16", {}).get("speedup_vs_off")
    if speedup is not None:
        bars["snippets_share16: >= 1.5x faster end to end with grouping than off"] = speedup >= 1.5
    return bars


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["off", "on"],
        choices=list(MODES),
        help="run order; 'nocache' also turns off the engine's block-hash prefix cache",
    )
    parser.add_argument("--repeats", type=int, default=1, help="medians over this many runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--key-tokens", type=int, default=16, help="prefix key tokens (PlanConfig.key_block_size)"
    )
    s = parser.add_argument_group("snippets")
    s.add_argument("--share-degree", type=int, default=16)
    s.add_argument("--doc-tokens", type=int, default=1000)
    s.add_argument("--query-tokens", type=int, default=50)
    s.add_argument("--docs", type=int, default=6, help="documents (production-scaled layout)")
    s.add_argument("--num-actors", type=int, default=2, help="engine actors (production layout)")
    s.add_argument(
        "--num-cpus-per-actor",
        type=float,
        default=0.25,
        help="scheduling share; 2 x 0.25 + the tokenizer's 0.25 leaves Ray Data a whole CPU",
    )
    s.add_argument(
        "--pool-docs",
        type=float,
        default=2.0,
        help="each engine actor's KV pool, in document prompts (production layout)",
    )
    s.add_argument("--max-rows-per-shard", type=int, default=16)
    s.add_argument("--fits-docs", type=int, default=4, help="documents (everything-fits layout)")
    h = parser.add_argument_group("hh-rlhf")
    h.add_argument("--hh-dialogues", type=int, default=40)
    h.add_argument("--hh-max-prompt-tokens", type=int, default=400)
    return parser


def _table(out: dict) -> str:
    lines = []
    for name in CONFIGS:
        if name not in out:
            continue
        r = out[name]
        lines.append(
            f"{name}: {r['rows']} rows, {r['num_actors']} actor(s), optimum "
            f"{r['optimal_saving_ratio']:.1%}, one-level {r['one_level_optimal_saving_ratio']:.1%}"
        )
        for mode, run in r["runs"].items():
            lines.append(
                f"  {mode:11}: {run['wall_s']:.1f}s ({run['cpu_s']:.0f} CPU s), "
                f"{run['rows_per_s']:.2f} rows/s, {run['generated_tokens_per_s']:.1f} gen tok/s, "
                f"{run['computed_prompt_tokens']:.0f} prompt tokens computed, "
                f"saving {run['prefix_saving_ratio']:.1%}"
            )
        lines += [f"  {k} {v:.2f}x" for k, v in r.items() if k.startswith(("speedup", "cpu_ratio"))]
    lines += [f"{k}: {'met' if v else 'NOT met'}" for k, v in out["bars"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
