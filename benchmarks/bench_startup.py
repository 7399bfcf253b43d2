"""Start-up: seconds from nothing to a model ready to generate, and the job's time to its
first engine step (issue 28 item 5; vLLM CPU took 141 s to load and compile SmolLM2-135M).

Each case is a fresh Python process, timed from the process's start (/proc), so the
interpreter, the imports, the model load and the first generated token are all in it:

* `engine_gguf_cold`: `LLMEngine(EngineConfig())`, the embedded SmolLM2 GGUF, with an empty
  cache folder (`RAYPACK_CACHE_DIR`): the GGUF converted and the attention kernel compiled,
  as on a machine's first run;
* `engine_gguf`: the same with the cache this machine has (the usual case);
* `engine_safetensors`: `EngineConfig(model=<a safetensors folder>)` (the converted SmolLM2);
* `job`: `raypack generate` on `--job-rows` Alpaca chat prompts, 8 new tokens, a local Ray
  started by the command; its phases (pipeline/job/phases.py, from `--json`'s `phases_s`) and
  the process's whole wall time.

Ready means one `generate` of one new token returned. Medians of `--repeats` (the cold case
once). Printed JSON names the machine (CPU model, ISA flags) and the 10-s target.

    python benchmarks/bench_startup.py --repeats 3 --json startup.json
"""

from __future__ import annotations

import argparse
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
if str(ROOT) not in sys.path:  # run as `python benchmarks/bench_startup.py` from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks._bench_common import emit, machine  # noqa: E402

TARGET_S = 10.0

# Run in a fresh interpreter: every import is part of the time.
ENGINE = """
import json, sys, time
from pipeline.job.phases import process_start
start = process_start()
from actors import EngineConfig, LLMEngine, SamplingParams
imported = time.time()
engine = LLMEngine(EngineConfig(model=sys.argv[1]))
loaded = time.time()
out = engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=1))
ready = time.time()
assert len(out[0].token_ids) == 1
print(json.dumps({
    "ready_s": round(ready - start, 2),
    "imports_s": round(imported - start, 2),
    "load_s": round(loaded - imported, 2),
    "first_token_s": round(ready - loaded, 2),
}))
"""


def engine_case(model: str, env: dict[str, str]) -> dict[str, Any]:
    """One fresh process from nothing to one generated token."""
    done = subprocess.run(
        [sys.executable, "-c", ENGINE, model],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"engine start-up failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def job_case(
    rows: int, work: Path, env: dict[str, str], extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """`raypack generate` on `rows` chat prompts (`extra`: more of its flags): its phases and
    its whole wall time."""
    from benchmarks.bench_job import alpaca_messages

    table = work / "prompts.parquet"
    if not table.exists():
        import pyarrow as pa
        import pyarrow.parquet as pq

        picked = alpaca_messages(rows, 0)
        pq.write_table(
            pa.table(
                {"id": [i for i, _ in picked], "messages": [json.dumps(m) for _, m in picked]}
            ),
            table,
        )
    output = work / "out"
    shutil.rmtree(output, ignore_errors=True)
    started = time.time()
    done = subprocess.run(
        [
            sys.executable, "-m", "pipeline.commands", "generate",
            "--input", str(table), "--output", str(output), "--messages-column", "messages",
            "--max-tokens", "8", "--no-progress", "--json", *extra,
        ],
        capture_output=True, text=True, timeout=900, env=env, cwd=ROOT, check=False,
    )  # fmt: skip
    wall = time.time() - started
    if done.returncode != 0:
        raise RuntimeError(f"the job failed: {done.stderr[-3000:]}")
    summary = json.loads(done.stdout[done.stdout.index("{") :])
    return {"wall_s": round(wall, 2), "rows": summary["rows"], **summary["phases_s"]}


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each numeric field's median over the runs, and the runs' `ready_s` / `wall_s`."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = round(statistics.median(r[key] for r in runs), 2)
        else:
            out[key] = value
    for key in ("ready_s", "to_first_step", "wall_s"):
        if key in runs[0]:
            out[f"{key}_runs"] = [r[key] for r in runs]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--job-rows", type=int, default=64)
    parser.add_argument("--no-job", action="store_true", help="the engine cases only")
    parser.add_argument("--no-cold", action="store_true", help="skip the empty-cache case")
    parser.add_argument("--json", help="write the JSON here too")
    args = parser.parse_args(argv)

    from actors.loader import cache_dir, ensure_embedded_converted

    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    folder = ensure_embedded_converted()  # the safetensors case's folder (and a warm cache)
    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    result: dict[str, Any] = {"machine": machine(), "target_s": TARGET_S, "cases": {}}
    cases = result["cases"]
    try:
        if not args.no_cold:
            cold = {**env, "RAYPACK_CACHE_DIR": str(work / "cache")}
            cases["engine_gguf_cold"] = medians([engine_case("smollm2", cold)])
        runs: dict[str, list[dict[str, Any]]] = {"engine_gguf": [], "engine_safetensors": []}
        for _ in range(args.repeats):  # interleaved: the machine's noise hits both alike
            runs["engine_gguf"].append(engine_case("smollm2", env))
            runs["engine_safetensors"].append(engine_case(str(folder), env))
        for name, done in runs.items():
            cases[name] = medians(done)
        if not args.no_job:
            jobs = [job_case(args.job_rows, work, env) for _ in range(args.repeats)]
            cases["job"] = medians(jobs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["cache_dir"] = str(cache_dir())
    result["engine_within_target"] = all(
        c["ready_s"] <= TARGET_S for k, c in cases.items() if k.startswith("engine")
    )
    emit(result, True, args.json)


if __name__ == "__main__":
    main()
