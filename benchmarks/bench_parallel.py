"""Benchmark the parallel engines on CPU: pp=2 step time and bubble fraction with equal token
budgets (Sarathi: chunked prefill, decodes first) against whole-prompt prefill steps, and
tp=2 against tp=1 step time.

    python benchmarks/bench_parallel.py --json

The model is SmolLM2-135M itself (30 layers, 15 per stage): a stage's compute per step (tens
to hundreds of ms on one core) is then large against the engine's own per-step cost, and the
last stage's LM head is its real share. (A random 4-layer, 512-wide llama with the 49k
vocabulary, this benchmark's earlier model, spends more on its LM head than on its two
layers: its last stage took 2.6x the first, so its bubble measured that imbalance, whatever
the budgets.) Prompts are a seeded mix of Alpaca and HH-RLHF dialogues (tens to hundreds of
tokens), so whole-prompt steps are uneven. pp steps run as one Ray task per worker per step
(the CPU default); a Ray compiled graph is timed beside it for equal budgets.

Two cores cannot show a parallel speedup (each stage or tp rank gets about one core, and the
driver's scheduling and sampling share them); what this shows is how evenly the stages are
kept busy. Each engine is built once and its `generate` timed in interleaved rounds; the
stage numbers are the workers' own busy spans (`take_timings`, tp rank 0), and the bubble
fraction is `1 - busy / (stages x span)` over each run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _bench_common import emit, interleaved, load_prompts, log, machine, median, sample


def build_model(folder: Path, layers: int, hidden: int) -> Path:
    """A random llama shaped like SmolLM2 (64-wide heads, half as many KV heads, MLP 3x,
    tied embeddings, its 49k vocabulary and tokenizer) but with an even head count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from actors.loader import load_tokenizer

    torch.manual_seed(0)
    heads = hidden // 64
    config = AutoConfig.for_model(
        "llama",
        vocab_size=49152,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    load_tokenizer("smollm2").save_pretrained(folder)
    return folder


def prompt_mix(count: int, seed: int) -> list[list[int]]:
    """`count` prompts, half Alpaca instructions and half HH-RLHF dialogues, shuffled."""
    from actors.loader import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    half = count // 2
    mix = sample(load_prompts("alpaca", tokenizer), count - half, seed)
    mix += sample(load_prompts("hh", tokenizer), half, seed)
    order = np.random.default_rng(seed).permutation(len(mix))
    return [mix[int(i)] for i in order]


def take_stage_stats(runner: Any) -> dict[str, Any]:
    """Per stage (tp rank 0), since the last call: median busy ms per step (wall and CPU),
    the CPU share of the busy time (below 1: the stage was descheduled mid-step), the idle
    share of the run's span, and the bubble fraction over all stages."""
    import ray

    from actors.parallel.pipelined import bubble_fraction

    timings = runner.take_timings()
    cpu = ray.get([stage[0].take_cpu_times.remote() for stage in runner.workers])
    spans = [(s, e) for stage in timings for _, s, e in stage]
    span = max(e for _, e in spans) - min(s for s, _ in spans)
    busy = [sum(e - s for _, s, e in stage) for stage in timings]
    return {
        "busy_ms": [float(np.median([1e3 * (e - s) for _, s, e in st])) for st in timings],
        "cpu_ms": [float(np.median([1e3 * c for _, c in st])) for st in cpu],
        "cpu_of_busy": [sum(c for _, c in st) / b for st, b in zip(cpu, busy, strict=True)],
        "idle_share": [1.0 - b / span for b in busy],
        "bubble": bubble_fraction(timings),
    }


def main() -> None:
    """Run the comparisons; print JSON with --json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="model name or folder")
    parser.add_argument(
        "--random-llama",
        default=None,
        metavar="LAYERSxHIDDEN",
        help="pp on a random llama of this size instead (e.g. 4x512, quick checks)",
    )
    parser.add_argument(
        "--tp-llama",
        default="30x512",
        metavar="LAYERSxHIDDEN",
        help="tp on a random SmolLM2-sized llama (SmolLM2's 9 heads, 3 KV heads cannot split)",
    )
    parser.add_argument("--prompts", type=int, default=32, help="half Alpaca, half HH-RLHF")
    parser.add_argument("--max-tokens", type=int, default=8, help="short outputs: snippets")
    parser.add_argument("--budget", type=int, default=128, help="equal token budget per step")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="running requests per set")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-compiled", action="store_true", help="skip pp through a Ray compiled graph"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    import ray
    import torch

    from actors import EngineConfig, LLMEngine, SamplingParams

    work = Path(tempfile.mkdtemp(prefix="rpb", dir="/tmp"))

    def random_llama(size: str, name: str) -> str:
        layers, hidden = (int(x) for x in size.lower().split("x"))
        return str(build_model(work / name, layers, hidden))

    model = random_llama(args.random_llama, "pp") if args.random_llama else args.model
    tp_model = random_llama(args.tp_llama, "tp")
    prompts = prompt_mix(args.prompts, args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    torch.set_num_threads(2)  # tp1 runs in this process on both cores; workers take one each
    ray.init(num_cpus=2, _temp_dir=str(work / "ray"), include_dashboard=False, log_to_driver=False)
    # Prefill-heavy, as raypack's offline jobs are (long prompts, short snippets), with room
    # to admit prompts while others decode: equal budgets then fill every step with decodes
    # plus prefill chunks, while whole-prompt steps swing between multi-prompt prefills and
    # decode-only steps. (With 4 running requests and 16 tokens out, the previous defaults,
    # most steps were 4-token decodes, identical in both modes.)
    base = dict(
        num_kv_blocks=512,
        worker_num_cpus=0.2,  # five engines (eight workers) fit in 2 CPUs
        enable_prefix_caching=False,
        max_num_seqs=args.max_num_seqs,
    )
    equal = dict(chunk_size=args.budget, max_num_batched_tokens=args.budget)
    whole = dict(max_num_batched_tokens=4096)
    pp2 = dict(model=model, pipeline_parallel_size=2)
    shapes: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
        "pp2_equal_budget": (pp2 | equal, {}),
        "pp2_whole_prompt": (pp2 | whole, {}),
        "pp2_equal_budget_compiled": (pp2 | equal, dict(compiled_graph=True)),
        "tp1": (dict(model=tp_model) | equal, {}),
        "tp2": (dict(model=tp_model, tensor_parallel_size=2) | equal, {}),
    }
    if args.no_compiled:
        del shapes["pp2_equal_budget_compiled"]
    # the tokens each engine must reproduce: a single-process engine on the same steps
    exact = {"pp2_equal_budget": "pp1_equal_budget", "pp2_whole_prompt": "pp1_whole_prompt"}
    exact |= {"pp2_equal_budget_compiled": "pp1_equal_budget", "tp2": "tp1"}
    references = {"pp1_equal_budget": dict(model=model) | equal}
    references["pp1_whole_prompt"] = dict(model=model) | whole
    engines = {n: LLMEngine(EngineConfig(**base, **c), **kw) for n, (c, kw) in shapes.items()}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    tokens: dict[str, Any] = {}

    def runner(name: str):
        engine = engines[name]

        def run() -> None:
            before, cpu = engine.stats.num_steps, time.process_time()
            outputs = engine.generate(prompts, params)
            record: dict[str, Any] = {
                "steps": engine.stats.num_steps - before,
                "driver_cpu_s": time.process_time() - cpu,
            }
            tokens[name] = [o.token_ids for o in outputs]
            if hasattr(engine.runner, "take_timings"):  # this run's worker busy times only
                record |= take_stage_stats(engine.runner)
            runs[name].append(record)

        return run

    try:
        for engine in engines.values():  # warm-up (weights paged in, graphs running)
            engine.generate(prompts[:4], params)
            if hasattr(engine.runner, "take_timings"):
                take_stage_stats(engine.runner)
        times = interleaved({n: runner(n) for n in engines}, args.repeats, log)
        for name, settings in references.items():  # untimed, one at a time (memory)
            reference = LLMEngine(EngineConfig(**base, **settings))
            tokens[name] = [o.token_ids for o in reference.generate(prompts, params)]
            del reference
        result: dict[str, Any] = {
            "machine": machine(),
            "note": "2 cores: each pp stage / tp rank gets about one core (one torch thread); "
            "the driver's scheduling and sampling share them, and tp1 runs in the driver",
            "pp_model": f"random llama {args.random_llama}" if args.random_llama else model,
            "tp_model": f"random llama {args.tp_llama} (64-wide heads, half as many KV heads)",
            "prompt_tokens": sorted(len(p) for p in prompts),
            "args": vars(args),
            "engines": {},
        }
        for name, engine in engines.items():
            wall, steps = median(times[name].wall), median([r["steps"] for r in runs[name]])
            entry: dict[str, Any] = {
                "generate_wall_s": round(wall, 3),
                "steps": steps,
                "wall_per_step_ms": round(1e3 * wall / steps, 2),
                "driver_cpu_per_step_ms": round(
                    1e3 * median([r["driver_cpu_s"] / r["steps"] for r in runs[name]]), 2
                ),
            }
            stages = range(len(runs[name][0].get("busy_ms", ())))
            for key, out, digits in (
                ("busy_ms", "stage_busy_per_step_ms", 2),
                ("cpu_ms", "stage_cpu_per_step_ms", 2),
                ("cpu_of_busy", "stage_cpu_of_busy", 3),
                ("idle_share", "stage_idle_share", 3),
            ):
                if stages and (key != "idle_share" or engine.config.pipeline_parallel_size > 1):
                    entry[out] = [
                        round(median([r[key][i] for r in runs[name]]), digits) for i in stages
                    ]
            if name in exact:
                entry[f"same_tokens_as_{exact[name]}"] = tokens[name] == tokens[exact[name]]
            if engine.config.pipeline_parallel_size > 1:
                entry["bubble_fraction"] = round(median([r["bubble"] for r in runs[name]]), 3)
                entry["bubble_fraction_runs"] = [round(r["bubble"], 3) for r in runs[name]]
            result["engines"][name] = entry
        result["machine"]["loadavg_end"] = list(os.getloadavg())
        emit(result, args.json, args.output)
    finally:
        for engine in engines.values():
            if hasattr(engine.runner, "shutdown"):
                engine.runner.shutdown()
        from pipeline.commands.shutdown import shutdown_ray

        shutdown_ray()  # collected first, on this thread (pipeline/commands/shutdown.py)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
