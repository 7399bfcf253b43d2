"""The job at scale with the tiny random model: output files and memory as rows grow.

For each row count, one job in a fresh subprocess (its own local Ray): `--rows` tiny prompts
(an id and a few words each), greedy, max_tokens 1 (as cheap per row as the engine allows),
into a fresh folder. Measured per job: the output files and their rows, every id once, the
driver's peak RSS (VmHWM of the driver process when the job returns, Ray started inside it),
and the largest RSS each kind of Ray worker process of that driver reached (sampled every
second through psutil, by process title: StatsCollector, FileWriter, the engine and tokenizer
actors, tasks). JSON out.

    python benchmarks/bench_scale.py --rows 100000,1000000 --out bench_scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/bench_scale.py` from anywhere
    sys.path.insert(0, str(ROOT))

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def write_input(path: Path, rows: int) -> None:
    """`rows` tiny prompts, written in slices (the bench's own memory stays small)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("id", pa.string()), ("prompt", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, 100_000):
            ids = range(start, min(rows, start + 100_000))
            writer.write_table(
                pa.table(
                    {
                        "id": [f"row-{i:09d}" for i in ids],
                        "prompt": [f"{WORDS[i % 10]} {WORDS[i // 10 % 10]} {i}" for i in ids],
                    },
                    schema=schema,
                )
            )


class WorkerPeaks:
    """Samples every Ray worker process's RSS each `period` seconds: the largest per title."""

    def __init__(self, period: float = 1.0) -> None:
        self.period = period
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> WorkerPeaks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.wait(self.period):
            # This driver's Ray only (its raylet and workers descend from it): other Ray
            # sessions on the machine are not ours to count.
            for proc in me.children(recursive=True):
                try:
                    cmd = " ".join(proc.cmdline())
                    rss = int(proc.memory_info().rss)
                except psutil.Error:
                    continue
                if not cmd.startswith("ray::"):
                    continue
                title = cmd.split()[0][len("ray::") :]  # e.g. MapWorker(MapBatches(InferStage))
                title = title[: title.rfind(")") + 1] if ")" in title else title.split(".")[0]
                self.peaks[title] = max(self.peaks.get(title, 0), rss)


def one_job(rows: int, work: Path, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Run in the subprocess: the job on `rows` rows; what it wrote and the memory peaks."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    import ray
    import ray.data

    from actors import EngineConfig, SamplingParams
    from pipeline.config import (
        ComputeConfig,
        FilesConfig,
        InputConfig,
        JobConfig,
        PlanConfig,
        PromptConfig,
    )
    from pipeline.io.resume import data_files
    from pipeline.job.run import run_job

    source, output = work / "in.parquet", work / "out"
    write_input(source, rows)
    config = JobConfig(
        input=InputConfig(str(source)),
        prompt=PromptConfig(prompt_column="prompt"),
        output=str(output),
        engine=EngineConfig(model=str(model), max_num_seqs=args.max_num_seqs),
        sampling=SamplingParams(max_tokens=1),
        plan=PlanConfig(
            max_rows_per_shard=args.rows_per_shard,
            num_partitions=max(1, rows // args.rows_per_partition),
        ),
        compute=ComputeConfig(num_cpus_per_actor=0.5, num_tokenize_actors=1),
        files=FilesConfig(),
    )
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    started = time.perf_counter()
    with WorkerPeaks() as peaks:
        summary = run_job(config)
    elapsed = time.perf_counter() - started
    with open("/proc/self/status") as status:  # before the checks below add their own
        hwm = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    from pipeline.commands.shutdown import shutdown_ray

    shutdown_ray()  # collected first, on this thread (pipeline/commands/shutdown.py)
    files = data_files(output)
    counts = [pq.ParquetFile(f).metadata.num_rows for f in files]
    ids = pq.read_table(output, columns=["id"]).column("id")
    return {
        "rows": rows,
        "wall_s": round(elapsed, 1),
        "rows_per_s": round(rows / elapsed, 1),
        "summary_rows": summary.rows,
        "error_rows": summary.error_rows,
        "num_shards": summary.num_shards,
        "num_partitions": config.plan.num_partitions,
        "files": len(files),
        "rows_per_file": counts,
        "every_id_once": len(ids) == rows and pc.count_distinct(ids).as_py() == rows,
        "driver_peak_rss_mib": round(hwm / 1024, 1),
        "worker_peak_rss_mib": {k: round(v / 2**20, 1) for k, v in sorted(peaks.peaks.items())},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="100000,1000000", help="row counts, comma-separated")
    parser.add_argument("--rows-per-shard", type=int, default=256)
    parser.add_argument(
        "--rows-per-partition",
        type=int,
        default=50_000,
        help="rows per shuffle partition (the job's default goes by input bytes, 64 MiB, which "
        "would put a million tiny rows in one partition)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--out", help="write the JSON here too")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the subprocess's job
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        result = one_job(args.one, Path(args.work), Path(args.model), args)
        (Path(args.work) / "result.json").write_text(json.dumps(result))
        return

    from tests.tiny_models import save_tiny_model

    results = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        model = save_tiny_model(Path(tmp) / "model")
        for rows in (int(r) for r in args.rows.split(",")):
            work = Path(tmp) / f"job-{rows}"
            work.mkdir()
            cmd = [
                sys.executable, __file__, "--one", str(rows), "--work", str(work),
                "--model", str(model), "--rows-per-shard", str(args.rows_per_shard),
                "--rows-per-partition", str(args.rows_per_partition),
                "--max-num-seqs", str(args.max_num_seqs), "--cpus", str(args.cpus),
            ]  # fmt: skip
            print(f"job of {rows} rows ...", file=sys.stderr, flush=True)
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            subprocess.run(cmd, check=True, env=env, stdout=sys.stderr)
            results.append(json.loads((work / "result.json").read_text()))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    base, *rest = results
    report = {
        "jobs": results,
        "driver_rss_vs_first": [
            round(r["driver_peak_rss_mib"] / base["driver_peak_rss_mib"], 3) for r in rest
        ],
        "cpus": os.cpu_count(),
    }
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
