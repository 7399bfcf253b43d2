"""The offline job against its own engine, in one run, on the same real prompts.

Alpaca instructions (../shared/data/alpaca_5000.json, `RAYPACK_DATA_DIR` to move it) as one
chat user turn each, greedy, at most `--max-tokens` new tokens, the embedded SmolLM2:

* `LLMEngine.generate` on all prompts in one call, in this process (torch on `--threads`
  threads, every core by default, and the job's engine on as many);
* `jobs/generate.py`'s job (`pipeline.job.run.run_job`) on the same rows as a Parquet messages
  column, once per shard size, each on a fresh local Ray (its start-up is the job's).

Printed JSON: each job's throughput as a share of the engine's (generated tokens per second),
the job's time breakdown (start-up: Ray and the model check; then the span of each Ray Data
operator: read, tokenize, plan, engine, write), the engine's own step seconds inside the job
(against the engine alone: the in-actor penalty), whether the outputs are token-identical, and
per engine step the number of running sequences (`--steps-file`; `--plot` draws it with the
shard boundaries, to show the batch stays full across them).

    python benchmarks/bench_job.py --num-prompts 512 --shard-sizes 32,64,256 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/bench_job.py` from anywhere
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from actors import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from actors.gc_pause import freeze_heap  # noqa: E402
from benchmarks.cpu_share import CpuSampler  # noqa: E402
from benchmarks.step_log import read_step_logs, step_recording_stage  # noqa: E402
from pipeline.commands.shutdown import shutdown_ray  # noqa: E402
from pipeline.config import ComputeConfig, InputConfig, JobConfig, PlanConfig, PromptConfig  # noqa: E402
from pipeline.job.run import run_job  # noqa: E402

DATA_DIR = Path(os.environ.get("RAYPACK_DATA_DIR", ROOT.parent / "shared" / "data"))
# Ray Data operator names (as in its stats) -> the breakdown's names; the first match wins
# (Ray fuses the id and tokenize stages into one operator).
STAGES = (
    ("TokenizeStage", "tokenize"),
    ("num_rows_per_block=1,", "plan"),  # one shard per block, after the plan
    ("StreamingRepartition", "read"),  # read blocks cut for the tokenizers
    ("Read", "read"),
    ("ListFiles", "read"),
    ("Repartition", "shuffle"),  # the keyed all-to-all (or the one-partition shortcut)
    ("PlanStage", "plan"),
    ("Recorded", "engine"),  # step_recording_stage's InferStage
    ("InferStage", "engine"),
    ("Write", "write"),
    ("write_shards", "write"),  # pipeline/io/writer.py's write tasks
)


def alpaca_messages(count: int, seed: int) -> list[tuple[str, list[dict]]]:
    """`count` Alpaca records drawn with a fixed seed, as (id, one user message)."""
    with open(DATA_DIR / "alpaca_5000.json") as f:
        records = json.load(f)
    picked = np.random.default_rng(seed).choice(len(records), size=count, replace=False)
    out = []
    for i in sorted(int(i) for i in picked):
        content = records[i]["instruction"]
        if records[i].get("input"):
            content += "\n\n" + records[i]["input"]
        out.append((f"alpaca-{i}", [{"role": "user", "content": content}]))
    return out


def prompt_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """The chat template with the generation prompt, as token ids (what the job's tokenize
    stage makes of a messages row; the job's own count is checked against it)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def engine_alone(
    rows: list,
    params: SamplingParams,
    threads: int,
    sampler: CpuSampler | None = None,
    dtype: str = "auto",
) -> dict[str, Any]:
    """All prompts through one `generate` call; its wall time, tokens and outputs by id
    (and with a `sampler`, the cores each process held during the call)."""
    import torch

    torch.set_num_threads(threads)
    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(dtype=dtype))
    freeze_heap()  # as the job's engine actors do
    prompts = [prompt_ids(engine.tokenizer, m) for _, m in rows]
    engine.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up (kernel, allocator)
    warm = engine.stats
    loaded = time.perf_counter()
    outs = engine.generate(prompts, params)
    ended = time.perf_counter()
    wall = ended - loaded
    stats = engine.stats
    result = {
        "load_s": round(loaded - started, 2),
        "generate_s": round(wall, 2),
        "generated_tokens": sum(len(o.token_ids) for o in outs),
        "steps": stats.num_steps - warm.num_steps,
        "step_s": round(stats.step_seconds - warm.step_seconds, 2),
        "outputs": {rid: list(o.token_ids) for (rid, _), o in zip(rows, outs, strict=True)},
        "prompt_tokens": {rid: len(p) for (rid, _), p in zip(rows, prompts, strict=True)},
        "cpu_cores": sampler.cores_between(loaded, ended) if sampler else {},
    }
    del engine
    gc.unfreeze()
    gc.collect()
    return result


def operator_spans(ds: Any) -> dict[str, list[float]]:
    """[first task start, last task end] of each breakdown stage (`time.perf_counter`, one
    clock for every process of the machine)."""
    spans: dict[str, list[float]] = {}
    todo = [ds.get_stats_summary()]
    while todo:
        summary = todo.pop()
        todo.extend(summary.parents)
        for op in summary.operators_stats:
            stage = next((v for k, v in STAGES if k in op.operator_name), None)
            if stage is None or op.earliest_start_time is None:
                continue
            start, end = spans.setdefault(stage, [float("inf"), 0.0])
            spans[stage] = [min(start, op.earliest_start_time), max(end, op.latest_end_time)]
    return spans


def run_one_job(
    table: Path,
    output: Path,
    shard_size: int,
    params: SamplingParams,
    steps_file: Path,
    threads: int | None,
    sampler: CpuSampler | None = None,
    dtype: str = "auto",
    allocator: str = "auto",
    actors: int | str = "auto",
) -> dict[str, Any]:
    """One job on a fresh local Ray; its wall time, breakdown, engine steps and outputs (and
    with a `sampler`, the cores each process held while the engine stepped)."""
    import ray

    started = time.perf_counter()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    config = JobConfig(
        input=InputConfig(str(table)),
        prompt=PromptConfig(messages_column="messages"),
        output=str(output),
        engine=EngineConfig(dtype=dtype),
        sampling=params,
        plan=PlanConfig(max_rows_per_shard=shard_size),
        compute=ComputeConfig(torch_threads=threads, num_actors=actors, allocator=allocator),
    )
    spans: dict[str, list[float]] = {}
    marks: dict[str, float] = {}

    def written(ds: Any) -> None:
        marks["written"] = time.perf_counter()
        spans.update(operator_spans(ds))

    ray_up = time.perf_counter()
    try:
        summary = run_job(config, infer_cls=step_recording_stage(steps_file), on_written=written)
        returned = time.perf_counter()
    finally:
        shutdown_ray()  # as `raypack generate` ends its own Ray: last, on this thread
    ended = time.perf_counter()
    out = pq.read_table(output, columns=["id", "generated_token_ids", "num_prompt_tokens"])
    steps = read_step_logs(steps_file)
    step_s = sum(s[3] for s in steps["steps"])
    first_step = min(s[0] for s in steps["steps"])
    last_step = max(s[0] + s[3] for s in steps["steps"])
    first_op = min(start for start, _ in spans.values())
    ends: dict[str, float] = {}  # each engine's last step's end
    for s in steps["steps"]:
        ends[s[4]] = max(ends.get(s[4], 0.0), s[0] + s[3])
    ids = out["id"].to_pylist()
    return {
        "wall_s": round(ended - started, 2),
        # run_job's call to its return: the job on a running Ray, as `ray job submit` runs it
        # (this benchmark's local cluster start and stop are the rest of wall_s)
        "job_s": round(returned - ray_up, 2),
        "breakdown_s": {
            # Ray, then the model check and the pipeline's set-up until the first read task
            "start_up": round(first_op - started, 2),
            "ray_init": round(ray_up - started, 2),
            # each stage from its first task's start to its last task's end (they overlap:
            # writes stream as shards finish; the engine actor loads while rows are read)
            **{k: round(end - start, 2) for k, (start, end) in spans.items()},
            "first_step_after_call": round(first_step - ray_up, 2),
            "plan_done_to_first_step": round(first_step - spans["plan"][1], 2),
            "engine_steps_span": round(last_step - first_step, 2),
            "engine_step_s": round(step_s, 2),
            # the last step's end less the first engine to finish's: one engine working alone
            "one_engine_tail": round(last_step - min(ends.values()), 2),
            "after_last_step": round(ended - last_step, 2),  # last write, summary, report
            "last_step_to_written": round(marks["written"] - last_step, 2),
            "written_to_return": round(returned - marks["written"], 2),  # summary, report
            "ray_shutdown_after_return": round(ended - returned, 2),
        },
        "rows": out.num_rows,
        "summary_rows": summary.rows,
        "phases_s": summary.phases_s,  # the job's own (pipeline/job/phases.py): from run_job's call
        "steps": len(steps["steps"]),
        "stepping_thread": steps["actor"],
        "engine_actors": steps["actors"],
        "running_per_step": [s[1] for s in steps["steps"]],
        "waiting_per_step": [s[2] for s in steps["steps"]],
        "step_times": [round(s[0] - first_step, 3) for s in steps["steps"]],
        "shards_done": [round(t - first_step, 3) for t in steps["shards_done"]],
        "outputs": dict(zip(ids, out["generated_token_ids"].to_pylist(), strict=True)),
        "prompt_tokens": dict(zip(ids, out["num_prompt_tokens"].to_pylist(), strict=True)),
        "cpu_cores": sampler.cores_between(first_step, last_step) if sampler else {},
        # the cores each process held from run_job's call to the first engine step
        "cpu_cores_start": sampler.cores_between(ray_up, first_step) if sampler else {},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--shard-sizes", default="32,64,256")
    parser.add_argument("--repeats", type=int, default=1, help="medians over this many runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count(),
        help="torch threads of the engine alone (its default: the cores); fewer than the "
        "cores leaves the rest to Ray and the pipeline, as on a GPU node",
    )
    parser.add_argument(
        "--job-threads",
        type=int,
        help="torch threads of each of the job's engine actors (default: the job's own, the "
        "cluster's CPUs over its engine actors)",
    )
    parser.add_argument(
        "--job-actors",
        type=lambda v: v if v == "auto" else int(v),
        default="auto",
        help="the job's engine actors (ComputeConfig.num_actors; default the job's own, auto)",
    )
    parser.add_argument(
        "--allocator",
        default="auto",
        choices=["auto", "tcmalloc", "system"],
        help="the job's engine actors' malloc (ComputeConfig.allocator)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="the engine's dtype, alone and in the job (auto: bfloat16 only on a CPU with "
        "native bf16; float32 is the exactness dtype)",
    )
    parser.add_argument("--steps-file", help="write running sequences per step (JSON) here")
    parser.add_argument("--plot", help="draw running sequences per step to this PNG")
    parser.add_argument("--json", help="write the JSON report to this file (too)")
    parser.add_argument(
        "--no-alone", action="store_true", help="the job only (no ratios): for long plot runs"
    )
    parser.add_argument(
        "--cpu-shares",
        action="store_true",
        help="sample every process's CPU (Linux /proc, each second) and report the cores each "
        "held while the engine stepped, alone and in the job",
    )
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.shard_sizes.split(",")]

    rows = alpaca_messages(args.num_prompts, args.seed)
    params = SamplingParams(max_tokens=args.max_tokens)  # temperature 0: greedy
    work = Path(tempfile.mkdtemp(prefix="bench-job-"))
    table = work / "prompts.parquet"
    pq.write_table(
        pa.table(
            {"id": [r for r, _ in rows], "messages": [json.dumps(m) for _, m in rows]},
        ),
        table,
    )
    alone_runs: list[dict] = []
    jobs: dict[str, list[dict]] = {str(s): [] for s in sizes}
    sampler = CpuSampler().start() if args.cpu_shares else None
    try:
        for rep in range(args.repeats):
            if not args.no_alone:
                alone_runs.append(engine_alone(rows, params, args.threads, sampler, args.dtype))
                print(f"rep {rep}: engine alone {alone_runs[-1]['generate_s']} s", file=sys.stderr)
            for size in sizes:
                key, out = str(size), work / f"out-{size}-{rep}"
                jobs[key].append(
                    run_one_job(
                        table,
                        out,
                        size,
                        params,
                        work / f"steps-{key}-{rep}.json",
                        args.job_threads,
                        sampler,
                        args.dtype,
                        args.allocator,
                        args.job_actors,
                    )
                )
                print(f"rep {rep}: job {key} {jobs[key][-1]['wall_s']} s", file=sys.stderr)
                shutil.rmtree(out, ignore_errors=True)
    finally:
        if sampler:
            sampler.stop()
        shutil.rmtree(work, ignore_errors=True)
    result = json.dumps(report(args, alone_runs, jobs), indent=2)
    if args.json:  # written first: Ray may print after us on stdout
        Path(args.json).write_text(result + "\n")
    print(result)
    if args.steps_file or args.plot:
        trace = {s: {k: runs[-1][k] for k in TRACE} for s, runs in jobs.items()}
        if args.steps_file:
            Path(args.steps_file).write_text(json.dumps(trace))
        if args.plot:
            plot(trace, args.plot)


TRACE = ("step_times", "running_per_step", "waiting_per_step", "shards_done")


def report(args: argparse.Namespace, alone_runs: list[dict], jobs: dict[str, list]) -> dict:
    """Medians of the runs, ratios of the same run, identity of the outputs (no ratios and
    no identity without the engine alone: `--no-alone`)."""
    result: dict[str, Any] = {
        "prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "allocator": args.allocator,
        "repeats": args.repeats,
        "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "jobs": {},
    }
    if alone_runs:
        ref = alone_runs[0]
        alone_s = statistics.median(r["generate_s"] for r in alone_runs)
        result["engine_alone"] = {
            "generate_s": alone_s,
            "runs_s": [r["generate_s"] for r in alone_runs],
            "tokens_per_s": round(ref["generated_tokens"] / alone_s, 1),
            "steps": ref["steps"],
            "step_s": statistics.median(r["step_s"] for r in alone_runs),
            "threads": args.threads,
            "cpu_cores_last_run": alone_runs[-1]["cpu_cores"],
        }
    for size, runs in jobs.items():
        last = runs[-1]
        running = last["running_per_step"]
        entry: dict[str, Any] = {
            "wall_s": statistics.median(j["wall_s"] for j in runs),
            "runs_s": [j["wall_s"] for j in runs],
            "job_s": statistics.median(j["job_s"] for j in runs),
            "breakdown_s": last["breakdown_s"],
            "phases_s": last["phases_s"],
            # every run's start-up and tail (the phases above are the last run's)
            "phases_runs_s": {
                k: [j["phases_s"].get(k) for j in runs]
                for k in ("to_first_step", "read_plan", "engine_imports", "engine_load", "steps")
            },
            "job_minus_steps_runs_s": [
                round(j["job_s"] - j["phases_s"].get("steps", 0.0), 2) for j in runs
            ],
            "one_engine_tail_runs_s": [j["breakdown_s"]["one_engine_tail"] for j in runs],
            "steps": last["steps"],
            "stepping_thread": last["stepping_thread"],
            "median_running_per_step": statistics.median(running),
            # steps after which the engine had no prompt waiting though rows were still to
            # come (the last shard's tail aside): where the feed ran dry
            "steps_with_none_waiting": sum(w == 0 for w in last["waiting_per_step"]),
            "rows": last["rows"],
            "generated_tokens": sum(len(v) for v in last["outputs"].values()),
            # the cores each process held while the engine stepped (--cpu-shares)
            "cpu_cores_during_steps": last["cpu_cores"],
            # and from run_job's call to the first step (on a running Ray)
            "cpu_cores_before_first_step": last["cpu_cores_start"],
            "first_step_after_s": last["breakdown_s"]["first_step_after_call"],
        }
        if alone_runs:
            pairs = list(zip(alone_runs, runs, strict=True))
            ratios = [a["generate_s"] / j["wall_s"] for a, j in pairs]
            running_ray = [a["generate_s"] / j["job_s"] for a, j in pairs]
            # the engine alone's stepping time over the job's first step to last (with several
            # engine actors their steps overlap: their summed step time is no speed)
            engine_ratios = [a["step_s"] / j["breakdown_s"]["engine_steps_span"] for a, j in pairs]
            entry.update(
                throughput_vs_engine=round(statistics.median(ratios), 3),
                ratios=[round(r, 3) for r in ratios],
                throughput_vs_engine_on_running_ray=round(statistics.median(running_ray), 3),
                ratios_on_running_ray=[round(r, 3) for r in running_ray],
                engine_step_speed_vs_alone=round(statistics.median(engine_ratios), 3),
                engine_step_speed_runs=[round(r, 3) for r in engine_ratios],
                token_identical_rows=sum(
                    last["outputs"].get(k) == v for k, v in ref["outputs"].items()
                ),
                same_prompt_length_rows=sum(
                    last["prompt_tokens"].get(k) == v for k, v in ref["prompt_tokens"].items()
                ),
            )
        result["jobs"][size] = entry
    return result


def plot(trace: dict[str, dict], path: str) -> None:
    """Running sequences per engine step over time, one panel per shard size, with a line
    where each shard finished."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(trace), 1, figsize=(9, 2.4 * len(trace)), squeeze=False)
    for ax, (size, t) in zip(axes[:, 0], trace.items(), strict=True):
        for done in t["shards_done"]:
            ax.axvline(done, color="0.85", lw=0.6)
        ax.plot(t["step_times"], t["running_per_step"], lw=1)
        ax.set_ylabel("running seqs")
        ax.set_title(f"{size}-row shards (grey: a shard finished)", fontsize=9)
    axes[-1, 0].set_xlabel("seconds since the engine's first step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
