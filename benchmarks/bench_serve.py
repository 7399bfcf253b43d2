"""Online admission benchmark: replay the Azure conversation trace against each policy.

    python benchmarks/bench_serve.py --json --png bench_serve.png

For each policy (immediate, fixed windows, aimd) deploy the app on a local Ray Serve (loopback,
free port), replay the same requests (load phases of rising rate from consecutive trace rows,
lengths scaled to fit a CPU), and report TTFT p50/p95/p99, end-to-end latency and throughput
per phase and overall, plus a PNG of TTFT over time with the aimd threshold N_t.
`--simulate` adds the same comparison on a noise-free model of the engine
(benchmarks/simulate.py); `--rounds 0` runs only that.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.replay import (  # noqa: E402
    HealthSample,
    Phase,
    Result,
    TraceRequest,
    build_requests,
    check_bar,
    read_trace,
    replay,
    summarise,
)
from benchmarks.simulate import StepCost, simulate  # noqa: E402
from packing.admission import AdmissionConfig  # noqa: E402
from pipeline.commands.shutdown import shutdown_ray  # noqa: E402
from pipeline.serve.cli import add_admission_arguments, admission_from_args  # noqa: E402

logger = logging.getLogger("raypack.bench_serve")
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--png", default="bench_serve.png", help="TTFT-over-time plot")
    p.add_argument("--out", default=None, help="also write the JSON report to this file")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--trace", default=str(DATA / "azure_llm_trace_2023_conv.csv"))
    p.add_argument("--corpus", default=str(DATA / "alpaca_5000.json"), help="prompt text")
    p.add_argument(
        "--phases", default="low:0.4:20,mid:1.0:15,high:2.0:15", help="name:rate/s:seconds,..."
    )
    p.add_argument(
        "--fixed", default="4:100,8:250", help="fixed windows as requests:ms,... (one run each)"
    )
    p.add_argument("--skip", default="", help="comma-separated policy labels to leave out")
    p.add_argument(
        "--rounds", type=int, default=2, help="live replays per policy, order alternating (0: none)"
    )
    p.add_argument("--simulate", action="store_true", help="add the noise-free modelled run")
    p.add_argument("--sim-fixed-ms", type=float, default=52.0, help="model: ms per step")
    p.add_argument("--sim-token-ms", type=float, default=1.31, help="model: ms per token")
    p.add_argument("--sim-request-ms", type=float, default=2.0, help="model: ms per request")
    p.add_argument("--length-scale", type=float, default=0.125, help="prompt length factor")
    p.add_argument("--output-scale", type=float, default=0.0625, help="output length factor")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-output-tokens", type=int, default=16)
    p.add_argument("--drain-s", type=float, default=45.0, help="wait after the last arrival")
    p.add_argument("--max-requests", type=int, default=400, help="refuse larger replays")
    p.add_argument(
        "--burn-in",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one untimed replay of the whole trace before the timed rounds (the first replay "
        "after start-up measured several times slower than later ones, whatever the policy)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=16,
        help="untimed requests, 0.1 s apart, before the first replay (so the first policy "
        "replayed does not pay for the replica's first steps)",
    )
    add_admission_arguments(p)
    # aimd knobs for SmolLM2 on a 2-core CPU (TTFT of a lone request is a few hundred ms)
    p.set_defaults(
        policy="aimd",
        ttft_low_ms=300.0,
        ttft_high_ms=800.0,
        max_wait_ms=150.0,
        burst_arrival_rate=2.0,
        burst_queue_depth=8,
    )
    return p.parse_args(argv)


def policies(args: argparse.Namespace) -> dict[str, AdmissionConfig]:
    """Label -> AdmissionConfig of every run."""
    runs: dict[str, AdmissionConfig] = {"immediate": admission_from_args(args, policy="immediate")}
    for window in filter(None, args.fixed.split(",")):
        n, ms = window.split(":")
        runs[f"fixed-{n}-{ms}ms"] = admission_from_args(
            args, policy="fixed", window_requests=int(n), window_s=float(ms) / 1e3
        )
    runs["aimd"] = admission_from_args(args, policy="aimd")
    skip = set(filter(None, args.skip.split(",")))
    return {label: config for label, config in runs.items() if label not in skip}


def corpus_tokens(path: str, tokenizer: Any) -> list[int]:
    """One long token stream of real text (instruction, input and output of every record)."""
    records = json.loads(Path(path).read_text())
    text = "\n\n".join(
        " ".join(filter(None, (r["instruction"], r["input"], r["output"]))) for r in records
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def plot(
    path: str, runs: dict[str, tuple[list[Result], list[HealthSample]]], phases: list[Phase]
) -> None:
    """TTFT of every request over its arrival time per policy; N_t of aimd below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, height_ratios=[3, 1])
    for label, (results, _) in runs.items():
        ok = sorted((r.arrival_s, r.ttft_s) for r in results if r.ttft_s is not None)
        top.plot([a for a, _ in ok], [t for _, t in ok], ".-", ms=3, lw=0.6, label=label)
    edge = 0.0
    for phase in phases:
        top.axvline(edge, color="grey", lw=0.5)
        top.text(
            edge + 1,
            0.98,
            f"{phase.name} {phase.rate}/s",
            transform=top.get_xaxis_transform(),
            va="top",
        )
        edge += phase.duration_s
    top.set_ylabel("TTFT (s)")
    top.set_yscale("log")
    top.legend(loc="upper left", fontsize=8)
    if "aimd" in runs:
        samples: list[HealthSample] = runs["aimd"][1]
        bottom.step(
            [s.t_s for s in samples], [s.threshold for s in samples], where="post", label="aimd N_t"
        )
        bottom.plot(
            [s.t_s for s in samples], [s.waiting for s in samples], lw=0.6, label="aimd queue depth"
        )
        bottom.legend(loc="upper left", fontsize=8)
    bottom.set_xlabel("arrival time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """Run every policy on the same replay and print the comparison."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = parse_args(argv)
    from actors.loader import load_tokenizer

    phases = [
        Phase(n, float(r), float(d)) for n, r, d in (s.split(":") for s in args.phases.split(","))
    ]
    tokenizer = load_tokenizer(args.model)
    requests = build_requests(
        read_trace(Path(args.trace)),
        phases,
        corpus_tokens(args.corpus, tokenizer),
        length_scale=args.length_scale,
        output_scale=args.output_scale,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
    )
    if len(requests) > args.max_requests:
        raise SystemExit(f"{len(requests)} requests exceed --max-requests={args.max_requests}")
    logger.info("replay: %d requests over %.0f s", len(requests), sum(p.duration_s for p in phases))
    configs = policies(args)
    report: dict[str, Any] = {
        "phases": [asdict(p) for p in phases],
        "requests": len(requests),
        "mean_prompt_tokens": float(np.mean([len(r.prompt_token_ids) for r in requests])),
        "mean_output_tokens": float(np.mean([r.max_tokens for r in requests])),
        "policies": {label: asdict(config) for label, config in configs.items()},
    }
    if args.simulate:
        cost = StepCost(args.sim_fixed_ms / 1e3, args.sim_token_ms / 1e3, args.sim_request_ms / 1e3)
        modelled = {
            label: summarise(simulate(requests, config, cost), phases, 1)
            for label, config in configs.items()
        }
        report["simulated"] = {
            "step_cost": asdict(cost),
            "results": modelled,
            "bar": check_bar(modelled, phases),
        }
    if args.rounds > 0:
        runs, by_round = run_live(args, requests, phases, configs)
        summary = {label: summarise(res, phases, args.rounds) for label, (res, _) in runs.items()}
        report["rounds"] = args.rounds
        report["results"] = summary
        report["bar"] = check_bar(summary, phases)
        # the spread between rounds of one policy is the noise floor of this machine
        report["overall_ttft_p95_s_by_round"] = {
            label: [r["ttft_p95_s"] for r in rounds] for label, rounds in by_round.items()
        }
        if args.png:
            plot(args.png, runs, phases)
            report["png"] = args.png
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        sys.stdout.write(text + "\n")
    else:
        logger.info("%s", text)
    return 0


def run_live(
    args: argparse.Namespace,
    requests: list[TraceRequest],
    phases: list[Phase],
    configs: dict[str, AdmissionConfig],
) -> tuple[dict[str, tuple[list[Result], list[HealthSample]]], dict[str, list[dict[str, float]]]]:
    """Replay on one live replica, switching policy in place; pooled results and per-round
    overall summaries."""
    import ray
    from ray import serve

    from actors.config import EngineConfig
    from pipeline.serve.app import build_app
    from pipeline.serve.config import ServeConfig

    temp_dir = tempfile.mkdtemp(prefix="rpb", dir="/tmp")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    runs: dict[str, tuple[list[Result], list[HealthSample]]] = {}
    by_round: dict[str, list[dict[str, float]]] = {}
    ray.init(num_cpus=2, _temp_dir=temp_dir, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = ServeConfig(
            engine=EngineConfig(model=args.model),
            served_model_name="bench",
            max_waiting=1024,
            max_ongoing_requests=2048,
            # every request served, as measured before the 30 s default deadline: a shed
            # request would leave the policies' TTFT distributions
            max_queue_wait_s=None,
            api_keys_env=None,
        )
        serve.run(build_app(config), name="bench", route_prefix="/")
        handle = serve.get_app_handle("bench")
        warm = [replace(r, arrival_s=0.1 * i) for i, r in enumerate(requests[: args.warmup])]
        if warm:
            asyncio.run(replay(base, "bench", warm, drain_s=120))
        if args.burn_in:
            first = next(iter(configs.values()))
            handle.reconfigure.remote({"admission": asdict(first)}).result()
            asyncio.run(replay(base, "bench", requests, drain_s=args.drain_s))
            wait_idle(base)
        for round_index in range(args.rounds):
            # alternate the order so a drift in background load does not favour one policy
            order = list(configs) if round_index % 2 == 0 else list(reversed(configs))
            for label in order:
                handle.reconfigure.remote({"admission": asdict(configs[label])}).result()
                started = time.monotonic()
                results, samples = asyncio.run(
                    replay(base, "bench", requests, drain_s=args.drain_s)
                )
                logger.info("round %d %s: %.0f s", round_index, label, time.monotonic() - started)
                previous = runs.get(label, ([], []))
                runs[label] = (previous[0] + results, previous[1] or samples)
                by_round.setdefault(label, []).append(summarise(results, phases, 1)["overall"])
                wait_idle(base)
    finally:
        serve.shutdown()
        shutdown_ray()  # collected first, on this thread (pipeline/commands/shutdown.py)
        shutil.rmtree(temp_dir, ignore_errors=True)
    return runs, by_round


def wait_idle(base: str, timeout_s: float = 120.0) -> None:
    """Block until the server has nothing waiting or running (between runs)."""
    import requests as http

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = http.get(f"{base}/health", timeout=10).json()
        if health["waiting"] == 0 and health["running"] == 0:
            return
        time.sleep(0.5)
    logger.warning("the server is still busy after %.0f s", timeout_s)


if __name__ == "__main__":
    sys.exit(main())
