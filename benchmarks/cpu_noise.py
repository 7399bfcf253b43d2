"""The engine's step speed beside other processes' short CPU bursts, as a Ray node's are.

On a node where the engine's torch threads take every core, each other process that wakes
(Ray's raylet, GCS and agents, Ray Data's executor loop and actors: ~0.14 of a core in all on
this box, `bench_job.py --cpu-shares`) takes a core from one torch thread, and the other
thread waits for it at the end of the parallel section. This measures what that costs the
engine alone, outside Ray: the same `generate` call in a fresh process, quiet, and beside

* `--noise-procs` processes that each wake every `--period-ms` and burn `--burst-ms`, with
  the engine at nice 0 and at nice 15 (Ray starts its workers at nice 15, so an engine actor
  runs there);
* an idle local Ray node (`--ray-node`): Ray started as `bench_job.py` starts it, after a
  small Ray Data pipeline with an actor pool has run on it, so Ray Data's detached actors
  (its stats actor, autoscaling coordinator and actor location tracker) and Ray's pooled
  idle workers are up, as on any cluster a Ray Data job has run on. Every Ray worker's main
  thread wakes every 10 ms (Ray's core worker checks for signals that often), busy or not.
  The engine runs at nice 15, as in an engine actor. This is the floor a job on the node
  cannot go below; `bench_job.py`'s engine step speed against it is what the job adds;
* the same node with a Ray Data pipeline running whose one task never ends: Ray Data's
  streaming executor loops (every 0.1 s while a task is out) in the node's driver, as in a
  job's driver, and calls its actors, while nothing else happens.

Each case runs in a fresh process, the cases alternate, and the report gives each case's
median seconds per step and its ratio to quiet.

    RAYPACK_DATA_DIR=<the datasets' folder> python benchmarks/cpu_noise.py --repeats 2 --json noise.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CASES = {  # name -> (what runs beside the engine, the engine's niceness)
    "quiet": (None, 0),
    "noise": ("bursts", 0),
    "noise, engine at nice 15": ("bursts", 15),
    "idle Ray node, engine at nice 15": ("ray", 15),
    "Ray Data job waiting, engine at nice 15": ("ray-data-waiting", 15),
}
RAY_NODE_SETTLE_S = 5.0  # after the node's pipeline: its tasks' workers go idle


def ray_node() -> None:
    """Start Ray as bench_job.py does and run a small Ray Data pipeline with an actor pool
    (its detached actors stay up), say "ready" and sleep until killed. Told "wait" on stdin
    meanwhile, start another pipeline whose one task never ends, so Ray Data's executor keeps
    looping in this process as it does in a job's driver, and say "waiting"."""
    import threading

    import ray
    import ray.data

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False

    class Double:
        def __call__(self, batch: dict) -> dict:
            return {"id": batch["id"] * 2}

    class Wait:
        def __call__(self, batch: dict) -> dict:
            time.sleep(3600)
            return batch

    ray.data.range(64).map_batches(Double, concurrency=1, num_cpus=0.1).materialize()
    print("ready", flush=True)
    try:  # ray.init's SIGTERM handler raises SystemExit in the read or the sleep
        if sys.stdin.readline().strip() == "wait":  # "" at once when stdin is not a pipe
            pipeline = ray.data.range(1).map_batches(Wait, concurrency=1, num_cpus=0.1)
            threading.Thread(target=pipeline.materialize, daemon=True).start()
            time.sleep(RAY_NODE_SETTLE_S)  # its actor up, its one task running
            print("waiting", flush=True)
        time.sleep(3600)
    finally:
        end_ray_node()


def end_ray_node() -> None:
    """Ray's shutdown (`shutdown_ray`), then end what it left. Its graceful stop gives the
    raylet 1 s before SIGKILL; on a busy box that is too short, and the raylet's dashboard and
    runtime-env agents then take a SIGKILLed raylet for a crash and try to report it to the GCS
    (already gone) before they fate-share, which took more than 30 s in CI."""
    import psutil

    from pipeline.commands.shutdown import shutdown_ray

    children = psutil.Process().children(recursive=True)
    shutdown_ray()  # collected first, on this thread (pipeline/commands/shutdown.py)
    alive = [p for p in children if p.is_running()]
    for p in alive:
        p.terminate()
    _, alive = psutil.wait_procs(alive, timeout=10)
    for p in alive:
        p.kill()


def burn(period_s: float, burst_s: float, seconds: float) -> None:
    """Wake every `period_s`, spin `burst_s`, for `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(period_s)
        started = time.perf_counter()
        while time.perf_counter() - started < burst_s:
            pass


def step_seconds(
    model: str, prompts: list[list[int]], max_tokens: int, threads: int, nice: int
) -> dict[str, float]:
    """One warm `generate` of `prompts` in this process; its steps and seconds per step."""
    import torch

    from actors import EngineConfig, LLMEngine, SamplingParams

    torch.set_num_threads(threads)
    if nice:
        os.nice(nice)
    engine = LLMEngine(EngineConfig(model=model))
    engine.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
    warm = engine.stats
    engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    stats = engine.stats
    steps = stats.num_steps - warm.num_steps
    return {"steps": steps, "step_s": (stats.step_seconds - warm.step_seconds) / steps}


def alpaca(num_prompts: int) -> tuple[str, list[list[int]]]:
    """bench_job.py's chat-templated Alpaca prompts for the embedded model."""
    from actors.loader import EMBEDDED_NAME, load_tokenizer
    from benchmarks.bench_job import alpaca_messages, prompt_ids

    tokenizer = load_tokenizer(EMBEDDED_NAME)
    return EMBEDDED_NAME, [prompt_ids(tokenizer, m) for _, m in alpaca_messages(num_prompts, 0)]


def ray_node_says(node: subprocess.Popen, line: str, told: str | None = None) -> bool:
    """Whether the `--ray-node` process says `line` next (after being told `told`)."""
    if told is not None:
        assert node.stdin is not None
        node.stdin.write(told + "\n")
        node.stdin.flush()
    return node.stdout is not None and node.stdout.readline().strip() == line


def run_case(name: str, args: argparse.Namespace, prompts_file: Path) -> dict[str, float]:
    """`name`'s measurement in a fresh process (a niceness cannot be lowered again)."""
    beside, nice = CASES[name]
    procs: list[subprocess.Popen] = []  # what runs beside the engine
    if beside == "bursts":
        burn_args = [str(args.period_ms / 1e3), str(args.burst_ms / 1e3), "3600"]
        procs = [
            subprocess.Popen([sys.executable, __file__, "--burn", *burn_args])
            for _ in range(args.noise_procs)
        ]
    elif beside in ("ray", "ray-data-waiting"):
        node = subprocess.Popen(
            [sys.executable, __file__, "--ray-node"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs = [node]
        if not ray_node_says(node, "ready") or (
            beside == "ray-data-waiting" and not ray_node_says(node, "waiting", "wait")
        ):
            node.kill()
            raise RuntimeError(f"the Ray node of {name!r} did not start")
        time.sleep(RAY_NODE_SETTLE_S)
    try:
        out = subprocess.run(
            [sys.executable, __file__, "--measure", str(prompts_file), str(nice)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    finally:
        for p in procs:  # SIGTERM ends a burner; a Ray node's handler shuts the node down
            p.terminate()
            p.wait(timeout=60)
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--burn":
        burn(*(float(a) for a in argv[1:4]))
        return
    if argv and argv[0] == "--ray-node":
        ray_node()
        return
    if argv and argv[0] == "--measure":
        spec = json.loads(Path(argv[1]).read_text())
        result = step_seconds(
            spec["model"], spec["prompts"], spec["max_tokens"], spec["threads"], int(argv[2])
        )
        print(json.dumps(result))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=192)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--noise-procs", type=int, default=10)
    parser.add_argument("--period-ms", type=float, default=100.0)
    parser.add_argument("--burst-ms", type=float, default=1.4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--case",
        action="append",
        choices=list(CASES),
        help="run this case (repeat the flag for more; quiet always runs); default: all",
    )
    parser.add_argument("--json", help="write the report to this file (too)")
    args = parser.parse_args(argv)
    names = ["quiet"] + [n for n in args.case or CASES if n != "quiet"]

    model, prompts = alpaca(args.num_prompts)
    spec = {
        "model": model,
        "prompts": prompts,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
    }
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file = Path(tmp) / "spec.json"
        prompts_file.write_text(json.dumps(spec))
        runs: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(args.repeats):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                runs[name].append(run_case(name, args, prompts_file)["step_s"])
    quiet = statistics.median(runs["quiet"])
    report = {
        "threads": args.threads,
        "noise_cores": round(args.noise_procs * args.burst_ms / args.period_ms, 3),
        "step_s_runs": {k: [round(v, 4) for v in vs] for k, vs in runs.items()},
        "step_s_vs_quiet": {k: round(statistics.median(vs) / quiet, 3) for k, vs in runs.items()},
        "loadavg": list(os.getloadavg()),
    }
    from benchmarks._bench_common import emit  # here: it imports torch, the burners do not

    emit(report, True, args.json)


if __name__ == "__main__":
    main()
