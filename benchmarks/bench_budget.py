"""Step token budget: fixed budgets against the TPOT controller on a replayed Azure trace.

    RAYPACK_DATA_DIR=../shared/data python benchmarks/bench_budget.py --json --out budget.json \\
        --png docs/step_budget.png --lock /tmp/raypack-ray.lock

Each configuration is an `LLMEngine` (the embedded SmolLM2 by default, all sharing one loaded
model) driven in this process as a Serve replica drives it: requests join at their arrival
times (consecutive rows of the Azure conversation trace, the arrival times scaled to `--rate`,
prompt and output lengths scaled for a CPU; prompts are real text, outputs forced to their
trace length with `ignore_eos`) and the engine steps whenever it has work. Chunk size as Serve
sets it (half the configured budget). Rounds alternate the order of the configurations; with
`--lock` each round (or replay) holds that file lock, so other tests do not run during it. The JSON has
p50/p95 TTFT and TPOT, the share meeting each SLO and goodput per configuration (rounds
pooled and per round), and the controller's budget per step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import asdict, astuple, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._bench_common import held  # noqa: E402
from benchmarks.replay import Phase, TraceRequest, build_requests, read_trace  # noqa: E402
from benchmarks.slo import Timing, summarise  # noqa: E402

logger = logging.getLogger("raypack.bench_budget")
DATA = Path(os.environ.get("RAYPACK_DATA_DIR", ROOT.parent / "shared" / "data"))


@dataclass
class Replay:
    """What one replay of one configuration measured."""

    timings: list[Timing]
    steps: list[tuple[float, float, int]]  # (seconds since start, step seconds, budget)
    loadavg: tuple[float, float]  # 1-minute load average before and after


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--out", help="also write the JSON report here")
    p.add_argument("--png", help="plot: TTFT and TPOT distributions, the controller's budget")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--trace", default=str(DATA / "azure_llm_trace_2023_conv.csv"))
    p.add_argument("--corpus", default=str(DATA / "alpaca_5000.json"), help="prompt text")
    p.add_argument("--budgets", default="128,256,512", help="fixed budgets, tokens per step")
    p.add_argument("--tpot-target-ms", type=float, default=300.0, help="the controller's target")
    p.add_argument("--ceiling", type=int, default=512, help="the controller's configured budget")
    p.add_argument("--ttft-slo-s", type=float, default=2.0)
    p.add_argument("--tpot-slo-ms", type=float, default=None, help="default: the target")
    p.add_argument("--rate", type=float, default=1.8, help="requests per second offered")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per replay")
    p.add_argument("--trace-offset", type=int, default=0, help="first trace row used")
    p.add_argument("--length-scale", type=float, default=0.25)
    p.add_argument("--output-scale", type=float, default=0.25)
    p.add_argument("--max-prompt-tokens", type=int, default=768)
    p.add_argument("--max-output-tokens", type=int, default=64)
    p.add_argument("--drain-s", type=float, default=20.0, help="after the last arrival, at most")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: two threads stalled 10-20x on this shared 2-core box whenever "
        "another process ran)",
    )
    p.add_argument("--kv-cache-memory-gb", type=float, default=0.5)
    p.add_argument(
        "--simulate", action="store_true", help="add the noise-free model (benchmarks/simulate.py)"
    )
    p.add_argument("--sim-fixed-ms", type=float, default=35.0, help="model: ms per step")
    p.add_argument("--sim-token-ms", type=float, default=1.3, help="model: ms per token")
    p.add_argument("--sim-request-ms", type=float, default=2.0, help="model: ms per request")
    p.add_argument("--lock", help="hold this file lock (flock) during each replay (or round)")
    p.add_argument(
        "--lock-scope",
        choices=["replay", "round"],
        default="round",
        help="hold the lock for each replay, or for each round of all configurations",
    )
    return p.parse_args(argv)


def configs(args: argparse.Namespace) -> dict[str, Any]:
    """Label -> EngineConfig of every configuration compared."""
    from actors.config import EngineConfig

    def engine(budget: int, **extra: Any) -> EngineConfig:
        return EngineConfig(
            model=args.model,
            max_num_batched_tokens=budget,
            chunk_size=max(1, budget // 2),  # as Serve sets it (pipeline/serve/config.py)
            kv_cache_memory_gb=args.kv_cache_memory_gb,
            **extra,
        )

    out = {f"fixed-{b}": engine(int(b)) for b in args.budgets.split(",") if b}
    label = f"tpot-{args.tpot_target_ms:g}ms (ceiling {args.ceiling})"
    out[label] = engine(args.ceiling, tpot_target_s=args.tpot_target_ms / 1e3)
    return out


def run_replay(engine: Any, requests: list[TraceRequest], drain_s: float) -> Replay:
    """Add each request at its arrival time and step the engine while it has work, as a
    Serve replica's step loop does (a request arriving mid-step joins at the next one)."""
    from actors import SamplingParams

    engine.reset_prefix_cache()
    load_before = os.getloadavg()[0]
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, tuple[float, int]] = {}
    steps: list[tuple[float, float, int]] = []
    t0 = time.monotonic()
    deadline = t0 + max(r.arrival_s for r in requests) + drain_s
    cursor = 0
    while len(done) < len(requests) and time.monotonic() < deadline:
        now = time.monotonic()
        while cursor < len(order) and t0 + requests[order[cursor]].arrival_s <= now:
            r = requests[order[cursor]]
            params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
            rid = engine.add_request(list(r.prompt_token_ids), params, f"r{order[cursor]}")
            arrival[rid] = t0 + r.arrival_s
            cursor += 1
        if not engine.has_unfinished():
            if cursor < len(order):
                time.sleep(max(0.0, t0 + requests[order[cursor]].arrival_s - time.monotonic()))
            continue
        started = time.monotonic()
        outputs = engine.step()
        ended = time.monotonic()
        budget = engine.config.max_num_batched_tokens
        if engine.step_budget is not None:
            budget = engine.step_budget.current
        steps.append((started - t0, ended - started, budget))
        for out in outputs:
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = ended
            if out.finished:
                done[out.request_id] = (ended, len(out.token_ids))
    for rid in arrival:  # unfinished at the bound: aborted, counted as missing both SLOs
        if rid not in done:
            engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    timings = []
    for index in range(len(requests)):
        rid = f"r{index}"
        end = done.get(rid)
        timings.append(
            Timing(
                arrival_s=arrival.get(rid, t0 + requests[index].arrival_s),
                first_token_s=first.get(rid),
                finished_s=end[0] if end else None,
                output_tokens=end[1] if end else 0,
            )
        )
    return Replay(timings, steps, (load_before, os.getloadavg()[0]))


def simulated(
    args: argparse.Namespace, requests: list[TraceRequest], tpot_slo: float
) -> dict[str, Any]:
    """The same comparison on the noise-free engine model (linear step cost, the same
    decode-first budget and the same controller rule), per configuration."""
    from benchmarks.simulate import StepCost, simulate
    from packing.admission import AdmissionConfig

    cost = StepCost(args.sim_fixed_ms / 1e3, args.sim_token_ms / 1e3, args.sim_request_ms / 1e3)
    out: dict[str, Any] = {"step_cost": asdict(cost), "results": {}}
    for label, config in configs(args).items():
        results = simulate(
            requests,
            AdmissionConfig(policy="immediate"),
            cost,
            token_budget=config.max_num_batched_tokens,
            step_budget=config.step_budget_config(),
        )
        timings = [
            Timing(r.arrival_s, r.arrival_s + r.ttft_s, r.arrival_s + r.latency_s, r.output_tokens)
            for r in results
            if r.ttft_s is not None and r.latency_s is not None
        ]
        out["results"][label] = summarise(timings, args.ttft_slo_s, tpot_slo, args.duration)
    return out


def corpus_tokens(path: str, tokenizer: Any) -> list[int]:
    """One long token stream of real text (every Alpaca record's fields, in order)."""
    records = json.loads(Path(path).read_text())
    text = "\n\n".join(
        " ".join(filter(None, (r["instruction"], r["input"], r["output"]))) for r in records
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def main(argv: list[str] | None = None) -> int:
    """Replay the trace against every configuration, `--rounds` times, and report."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("actors.engine").setLevel(logging.WARNING)
    args = parse_args(argv)
    import torch

    from actors import LLMEngine
    from actors.loader import load_model, load_tokenizer

    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, torch.float32, "cpu") if args.rounds > 0 else None
    trace = read_trace(Path(args.trace))[args.trace_offset :]
    phase = Phase("replay", args.rate, args.duration)
    requests = build_requests(
        trace,
        [phase],
        corpus_tokens(args.corpus, tokenizer),
        length_scale=args.length_scale,
        output_scale=args.output_scale,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
    )
    tpot_slo = (args.tpot_slo_ms or args.tpot_target_ms) / 1e3
    modelled = simulated(args, requests, tpot_slo) if args.simulate else None
    engines = {
        label: LLMEngine(config, model=model, tokenizer=tokenizer)
        for label, config in configs(args).items()
        if args.rounds > 0
    }
    warm = [
        TraceRequest(0.05 * i, r.prompt_token_ids, 4, "warm") for i, r in enumerate(requests[:6])
    ]
    for engine in engines.values():
        run_replay(engine, warm, drain_s=60)
    runs: dict[str, list[Replay]] = {label: [] for label in engines}
    for round_index in range(args.rounds):
        order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        with held(args.lock if args.lock_scope == "round" else None):
            for label in order:
                with held(args.lock if args.lock_scope == "replay" else None):
                    replay = run_replay(engines[label], requests, args.drain_s)
                runs[label].append(replay)
                row = summarise(replay.timings, args.ttft_slo_s, tpot_slo, args.duration)
                logger.info("round %d %s: %s", round_index, label, json.dumps(row))
    report = {
        "model": args.model,
        "trace": Path(args.trace).name,
        "requests": len(requests),
        "rate": args.rate,
        "duration_s": args.duration,
        "mean_prompt_tokens": sum(len(r.prompt_token_ids) for r in requests) / len(requests),
        "mean_output_tokens": sum(r.max_tokens for r in requests) / len(requests),
        "slo": {"ttft_s": args.ttft_slo_s, "tpot_s": tpot_slo},
        "rounds": args.rounds,
        "threads": args.threads,
        "args": vars(args),
        "results": {
            label: summarise(
                [t for r in reps for t in r.timings],
                args.ttft_slo_s,
                tpot_slo,
                args.duration * len(reps),
            )
            for label, reps in runs.items()
        },
        "by_round": {
            label: [
                {
                    **summarise(r.timings, args.ttft_slo_s, tpot_slo, args.duration),
                    "loadavg": r.loadavg,
                    "steps": len(r.steps),
                }
                for r in reps
            ]
            for label, reps in runs.items()
        },
        "timings": {  # per round: (arrival, first token, finished, output tokens) per request
            label: [[list(astuple(t)) for t in r.timings] for r in reps]
            for label, reps in runs.items()
        },
        "controller_budget": {
            label: [(round(t, 3), round(s, 4), b) for t, s, b in reps[0].steps]
            for label, reps in runs.items()
            if label.startswith("tpot")
        },
    }
    if modelled is not None:
        report["simulated"] = modelled
    text = json.dumps(report, indent=1)
    if args.out:  # before the figure, so a plotting error loses no measurement
        Path(args.out).write_text(text + "\n")
    if args.png and args.rounds > 0:
        from benchmarks.plot_budget import plot

        plot(args.png, report)
    if args.json:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
