"""The paged decode attention kernel alone (`actors.kernels`, float32 and bfloat16): this
tree's kernels against the same kernels as built from another git revision, in one run.

Each case is `--seqs` sequences with key counts drawn uniformly from a range, SmolLM2-135M's
geometry by default (9 query heads, 3 KV heads, head_dim 64, 16-token blocks), the blocks
shuffled in one cache (the worst case: the engine's allocator mostly hands a sequence
consecutive blocks); the last-level cache is flushed before each call, so each call reads its
keys and values from memory as one layer of a decode step does. Per dtype and case, the two
builds are called interleaved (rotating order) `--repeats` times on torch's threads; the
medians, the speed-up, the KV bytes read per second and the largest difference between the
two builds' outputs are printed as JSON. A `runs` case times the shared-prefix run mode
(`PagedDecode.runs`) on the prefix set's step: `--runs` runs of `--run-keys` keys, each read by
`--members` decodes' query heads, all in one call (GFLOP/s counts both products). With `--engine N`, per dtype also the engine on N
Alpaca chat prompts (bench_peers' set), its decode backend calling each build in turn: the
`generate` seconds and the kernel's seconds within them.

    RAYPACK_DATA_DIR=../shared/data python benchmarks/bench_decode_kernel.py --baseline bc051ba \\
        --engine 175 --json
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _bench_common as common
import torch

from actors import kernels

CASES = {"short": (100, 300), "long": (1000, 1200)}  # key counts: Alpaca chat, prefix set
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def baseline_kernels(rev: str, workdir: Path) -> dict[torch.dtype, kernels.PagedDecode]:
    """The kernels of git revision `rev` (its actors/kernels sources), built in `workdir`."""
    archive = subprocess.run(
        ["git", "-C", str(common.ROOT), "archive", rev, "actors/kernels"],
        check=True,
        capture_output=True,
        timeout=60,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(workdir)], input=archive, check=True, timeout=60)
    compiler = shutil.which("cc") or shutil.which("gcc")
    out = {}
    for dtype, (source, _) in kernels.KERNELS.items():
        library = kernels.load_library(
            compiler, workdir / "build", workdir / source.relative_to(common.ROOT)
        )
        if library is None:
            raise SystemExit(f"the kernels of {rev} did not build")
        out[dtype] = kernels.PagedDecode(library, dtype)
    return out


def make_case(
    seqs: int, keys: tuple[int, int], args: argparse.Namespace, dtype: torch.dtype, seed: int
) -> dict[str, Any]:
    """Query, caches, shuffled block tables and key counts for one case."""
    gen = torch.Generator().manual_seed(seed)
    bs = args.block_size
    seq_lens = torch.randint(keys[0], keys[1] + 1, (seqs,), generator=gen)
    counts = [-(-int(n) // bs) for n in seq_lens]
    num_blocks = sum(counts)
    shape = (num_blocks, bs, args.kv_heads, args.dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(seqs, max(counts), dtype=torch.int64)
    used = 0
    for i, n in enumerate(counts):
        tables[i, :n] = order[used : used + n]
        used += n
    q = torch.randn(seqs, args.heads, args.dim, generator=gen).to(dtype)
    return {"q": q, "k": k_cache, "v": v_cache, "tables": tables, "seq_lens": seq_lens}


def run_case(
    builds: dict[str, kernels.PagedDecode], case: dict[str, Any], repeats: int
) -> dict[str, Any]:
    """Both builds on one case, interleaved with a rotating order, the last-level cache
    flushed (an untimed 128 MB sum) before each call, as the other layers of a step would:
    medians, speed-up, GB/s, their outputs' largest difference."""
    outs = {name: torch.empty_like(case["q"]) for name in builds}
    scale = case["q"].shape[-1] ** -0.5
    flush = torch.ones(32 * 2**20)
    times: dict[str, list[float]] = {name: [] for name in builds}
    names = list(builds)
    for rep in range(repeats + 1):  # the first round warms up (pages the caches in)
        for name in names[rep % 2 :] + names[: rep % 2]:
            flush.sum()
            start = time.perf_counter()
            builds[name].run(
                case["q"], case["k"], case["v"], case["tables"], case["seq_lens"], scale, outs[name]
            )
            if rep:
                times[name].append(time.perf_counter() - start)
    k = case["k"]
    row_bytes = k.shape[2] * k.shape[3] * k.element_size()
    kv_bytes = 2 * int(case["seq_lens"].sum()) * row_bytes
    result: dict[str, Any] = {"keys": int(case["seq_lens"].sum()), "kv_mb": kv_bytes / 1e6}
    for name, runs in times.items():
        ms = common.median(runs) * 1e3
        result[name] = {"median_ms": round(ms, 3), "kv_gb_s": round(kv_bytes / ms / 1e6, 1)}
    result["speedup"] = round(result["baseline"]["median_ms"] / result["tree"]["median_ms"], 2)
    gap = (outs["tree"].float() - outs["baseline"].float()).abs().max()
    result["max_abs_diff"] = float(gap)
    return result


def make_runs_case(args: argparse.Namespace, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    """Shared-prefix runs: `args.runs` runs of `args.run_keys` keys (blocks shuffled in one
    cache), each read by `args.members` x heads-per-kv-head query rows per kv head."""
    gen = torch.Generator().manual_seed(seed)
    bs, per_run = args.block_size, -(-args.run_keys // args.block_size)
    shape = (args.runs * per_run, bs, args.kv_heads, args.dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    tables = torch.randperm(args.runs * per_run, generator=gen).view(args.runs, per_run)
    keys = torch.full((args.runs,), per_run * bs, dtype=torch.int64)
    rows = args.kv_heads * args.members * (args.heads // args.kv_heads)
    start = torch.arange(args.runs + 1, dtype=torch.int64) * rows
    q = torch.randn(args.runs * rows, args.dim, generator=gen).to(dtype)
    return {"q": q, "k": k_cache, "v": v_cache, "tables": tables, "keys": keys, "start": start}


def run_runs_case(
    builds: dict[str, kernels.PagedDecode], case: dict[str, Any], repeats: int
) -> dict[str, Any]:
    """Both builds' run mode on one case, interleaved and flushed as `run_case` (the engine's
    other layers evict a layer's runs): medians, speed-up, GFLOP/s, largest difference between
    the two builds' outputs."""
    q = case["q"]
    outs = {name: torch.empty(q.shape, dtype=torch.float32) for name in builds}
    lses = {name: torch.empty(len(q)) for name in builds}
    scale = q.shape[-1] ** -0.5
    flush = torch.ones(32 * 2**20)
    times: dict[str, list[float]] = {name: [] for name in builds}
    names = list(builds)
    for rep in range(repeats + 1):
        for name in names[rep % 2 :] + names[: rep % 2]:
            flush.sum()
            start = time.perf_counter()
            builds[name].runs(
                q,
                case["k"],
                case["v"],
                case["tables"],
                case["keys"],
                case["start"],
                scale,
                outs[name],
                lses[name],
            )
            if rep:
                times[name].append(time.perf_counter() - start)
    rows_per_run = int(case["start"][1])
    flop = 4 * rows_per_run * int(case["keys"][0]) * q.shape[-1] * len(case["keys"])
    result: dict[str, Any] = {"rows": len(q), "gflop": round(flop / 1e9, 3)}
    for name, runs in times.items():
        ms = common.median(runs) * 1e3
        result[name] = {"median_ms": round(ms, 3), "gflop_s": round(flop / ms / 1e6, 1)}
    result["speedup"] = round(result["baseline"]["median_ms"] / result["tree"]["median_ms"], 2)
    result["max_abs_diff"] = float((outs["tree"] - outs["baseline"]).abs().max())
    return result


class TimedKernel:
    """A `PagedDecode` whose `run` and `runs` (what the decode backends call) add up their
    seconds."""

    def __init__(self, kernel: kernels.PagedDecode) -> None:
        self.kernel, self.dtype, self.seconds, self.calls = kernel, kernel.dtype, 0.0, 0

    def run(self, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        self.kernel.run(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        self.calls += 1

    def runs(self, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        self.kernel.runs(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        self.calls += 1


def run_engine(
    builds: dict[str, kernels.PagedDecode], dname: str, prompt_set: str, prompts: int, repeats: int
) -> dict[str, Any]:
    """The engine (defaults, `dname`) on bench_peers' `alpaca` set (`prompts` chat prompts) or
    its `prefix` set (8 documents x 16 questions), at most 64 new tokens, EOS stops, its
    decode backend calling each build in turn (interleaved, rotating): per build the median
    `generate` seconds and kernel seconds (plain decodes and shared runs)."""
    from actors import EngineConfig, LLMEngine, SamplingParams
    from actors.loader import load_tokenizer
    from benchmarks.bench_job import alpaca_messages, prompt_ids
    from benchmarks.peer_docs import prefix_messages

    tokenizer = load_tokenizer("smollm2")
    if prompt_set == "prefix":
        rows = prefix_messages(tokenizer, 8, 1000, 16, 0)
    else:
        rows = alpaca_messages(prompts, 0)
    ids = [prompt_ids(tokenizer, m) for _, m in rows]
    engine = LLMEngine(EngineConfig(dtype=dname))  # type: ignore[arg-type]
    decode = engine.runner.attention_backend.decode  # type: ignore[attr-defined]
    engine.generate(ids[:2], SamplingParams(max_tokens=2))  # warm-up
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in builds}
    names = list(builds)
    for rep in range(repeats):
        for name in names[rep % 2 :] + names[: rep % 2]:
            decode.kernel = timed = TimedKernel(builds[name])
            engine.reset_prefix_cache()
            start = time.perf_counter()
            engine.generate(ids, SamplingParams(max_tokens=64))
            runs[name].append((time.perf_counter() - start, timed.seconds))
            common.log(f"  engine {name}: {runs[name][-1]} ({timed.calls} kernel calls)")
    return {
        name: {
            "median_generate_s": round(common.median([r[0] for r in rs]), 3),
            "median_kernel_s": round(common.median([r[1] for r in rs]), 3),
            "runs": [(round(a, 3), round(b, 3)) for a, b in rs],
        }
        for name, rs in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="main", help="git revision to compare against")
    parser.add_argument("--seqs", type=int, default=175)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--cases", default="short,long,runs", help="of short, long, runs")
    parser.add_argument("--runs", type=int, default=8, help="runs case: shared runs")
    parser.add_argument("--run-keys", type=int, default=1040, help="runs case: keys per run")
    parser.add_argument("--members", type=int, default=16, help="runs case: decodes per run")
    parser.add_argument(
        "--engine",
        type=int,
        default=0,
        help="also time both builds inside the engine on this many Alpaca prompts",
    )
    parser.add_argument("--engine-repeats", type=int, default=2)
    parser.add_argument("--engine-set", choices=("alpaca", "prefix"), default="alpaca")
    parser.add_argument("--json", action="store_true", help="print the result JSON")
    parser.add_argument("--output", help="write the result JSON here")
    args = parser.parse_args()
    common.setup_torch(args.threads)
    tree = {dtype: kernels.paged_decode_kernel("cpu", dtype) for dtype in DTYPES.values()}
    if any(kernel is None for kernel in tree.values()):
        sys.exit("this tree's kernels did not build")
    result: dict[str, Any] = {"machine": common.machine(), "baseline": args.baseline}
    result["geometry"] = {k: getattr(args, k) for k in ("seqs", "heads", "kv_heads", "dim")}
    result["geometry"]["block_size"] = args.block_size
    with tempfile.TemporaryDirectory() as tmp:
        before = baseline_kernels(args.baseline, Path(tmp))
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            builds = {"baseline": before[dtype], "tree": tree[dtype]}
            for cname, keys in CASES.items():
                if cname not in args.cases.split(","):
                    continue
                case = make_case(args.seqs, keys, args, dtype, seed=len(cname))
                common.log(f"{dname} {cname}: {keys[0]}-{keys[1]} keys x {args.seqs} seqs")
                result[f"{dname}_{cname}"] = run_case(builds, case, args.repeats)
                common.log(f"  {result[f'{dname}_{cname}']}")
            if "runs" in args.cases.split(","):
                common.log(f"{dname} runs: {args.runs} x {args.run_keys} keys x {args.members}")
                runs_case = make_runs_case(args, dtype, seed=7)
                result[f"{dname}_runs"] = run_runs_case(builds, runs_case, args.repeats)
                common.log(f"  {result[f'{dname}_runs']}")
            if args.engine:
                result[f"{dname}_engine_{args.engine_set}"] = run_engine(
                    builds, dname, args.engine_set, args.engine, args.engine_repeats
                )
    common.emit(result, args.json, args.output)


if __name__ == "__main__":
    main()
