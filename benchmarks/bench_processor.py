"""The processor (`build_processor`) on a small table with several engine actors: how long a
user's Ray Data program waits for every row, run after run.

Alpaca instructions (../shared/data/alpaca_5000.json, `RAYPACK_DATA_DIR` to move it) as one
chat user turn each, a `ray.data.from_arrow` dataset with a messages column, greedy, at most
`--max-tokens` new tokens, the embedded SmolLM2, `concurrency=--concurrency` engine actors.
Each run is a fresh local Ray in its own process (its start-up counts, as in a user's
program). With `--baseline REV`, runs alternate between this tree and git revision `REV`
(its files unpacked to a temporary directory), so both see the same machine.

Printed JSON: per run the wall seconds from `processor(ds)` to the last row, the rows and
generated tokens, and each output block (one per shard, in the order they came) with when it
came, its rows, prompt tokens and generated tokens (blocks far apart in time mean an engine
actor idled while another still worked); per side the median and spread.

    RAYPACK_DATA_DIR=../shared/data python benchmarks/bench_processor.py --repeats 3 \\
        --baseline 390e969
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> None:
    """One timed run in this process, on a fresh local Ray; prints one JSON line."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import ray

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    import ray.data

    from actors import EngineConfig, SamplingParams
    from benchmarks.bench_job import alpaca_messages
    from pipeline import ProcessorConfig, build_processor

    ray.data.DataContext.get_current().enable_progress_bars = False
    rows = alpaca_messages(args.num_prompts, args.seed)
    ds = ray.data.from_arrow(
        pa.table({"id": [r for r, _ in rows], "messages": [m for _, m in rows]})
    )
    processor = build_processor(
        ProcessorConfig(
            engine=EngineConfig(dtype=args.dtype),
            sampling=SamplingParams(max_tokens=args.max_tokens),
            messages_column="messages",
            concurrency=args.concurrency,
        )
    )
    start = time.perf_counter()
    blocks = []
    for batch in processor(ds).iter_batches(batch_size=None, batch_format="pyarrow"):
        blocks.append(
            {
                "at_s": round(time.perf_counter() - start, 2),
                "rows": batch.num_rows,
                "prompt_tokens": pc.sum(batch.column("num_prompt_tokens")).as_py(),
                "generated_tokens": pc.sum(batch.column("num_generated_tokens")).as_py(),
            }
        )
    wall = time.perf_counter() - start
    result = {
        "wall_s": round(wall, 2),
        "rows": sum(b["rows"] for b in blocks),
        "tokens": sum(b["generated_tokens"] for b in blocks),
        "blocks": blocks,
    }
    print(json.dumps(result))
    from pipeline.commands.shutdown import shutdown_ray

    shutdown_ray()  # collected first, on this thread (pipeline/commands/shutdown.py)


def run_once(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """`child` in a new process whose imports (and Ray workers') come from `root`."""
    command = [
        sys.executable, str(ROOT / "benchmarks" / "bench_processor.py"), "--child",
        "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens),
        "--concurrency", str(args.concurrency), "--dtype", args.dtype, "--seed", str(args.seed),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        command,
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=args.timeout,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"a run from {root} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def unpack(rev: str, into: Path) -> Path:
    """Git revision `rev`'s tracked files under `into`."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True, timeout=120
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True, timeout=120)
    return into


def side(runs: list[dict[str, Any]]) -> dict[str, Any]:
    walls = [r["wall_s"] for r in runs]
    return {
        "runs": runs,
        "median_wall_s": round(statistics.median(walls), 2),
        "min_wall_s": min(walls),
        "max_wall_s": max(walls),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=525)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=2, help="engine actors")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="runs per side")
    parser.add_argument("--baseline", help="git revision to alternate with this tree")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--json", help="write the JSON report to this file (too)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return

    sys.path.insert(0, str(ROOT))
    from benchmarks import _bench_common as common

    result: dict[str, Any] = {"machine": common.machine(), "config": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        roots = {"tree": ROOT}
        if args.baseline:
            roots["baseline"] = unpack(args.baseline, Path(tmp))
        runs: dict[str, list] = {name: [] for name in roots}
        for i in range(args.repeats):
            for name, root in roots.items():
                common.log(f"run {i + 1}/{args.repeats}: {name}")
                runs[name].append(run_once(root, args))
    for name, got in runs.items():
        result[name] = side(got)
    if args.baseline:
        result["baseline_over_tree"] = round(
            result["baseline"]["median_wall_s"] / result["tree"]["median_wall_s"], 3
        )
    common.emit(result, True, args.json)


if __name__ == "__main__":
    main()
