"""Benchmark the parallel engines on CPU: pp=2 step time and bubble fraction with equal token
budgets (Sarathi: chunked prefill, decodes first) against whole-prompt prefill steps, and
tp=2 against tp=1 step time.

    python jobs/bench_parallel.py --json

Two cores cannot show a parallel speedup; what this shows is how evenly the pipeline's stages
are kept busy. Each engine is built once and its `generate` timed in interleaved rounds; the
per-step numbers are from the workers' own busy times (`take_timings`).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

from _bench_common import emit, interleaved, load_prompts, log, machine, median, sample


def build_model(folder: Path, layers: int, hidden: int) -> Path:
    """A random llama (4 heads, 2 KV heads) of the given size with the SmolLM2 tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from actors.loader import load_tokenizer

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=49152,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    load_tokenizer("smollm2").save_pretrained(folder)
    return folder


def main() -> None:
    """Run the comparisons; print JSON with --json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: a random llama)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--budget", type=int, default=64, help="equal token budget per step")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    import ray

    from actors import EngineConfig, LLMEngine, SamplingParams
    from actors.loader import load_tokenizer
    from actors.parallel.pipelined import bubble_fraction

    work = Path(tempfile.mkdtemp(prefix="rpb", dir="/tmp"))
    model = args.model or str(build_model(work / "model", args.layers, args.hidden))
    prompts = sample(load_prompts("alpaca", load_tokenizer("smollm2")), args.prompts, args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    ray.init(num_cpus=2, _temp_dir=str(work / "ray"), include_dashboard=False, log_to_driver=False)
    # Few running requests, so new prompts keep arriving beside decodes (continuous batching):
    # whole-prompt steps then swing between a long prefill and a few decodes.
    base = dict(
        model=model,
        num_kv_blocks=512,
        worker_num_cpus=0.3,
        enable_prefix_caching=False,
        max_num_seqs=args.max_num_seqs,
    )
    shapes: dict[str, dict[str, Any]] = {
        "pp2_equal_budget": dict(
            pipeline_parallel_size=2, chunk_size=args.budget, max_num_batched_tokens=args.budget
        ),
        "pp2_whole_prompt": dict(pipeline_parallel_size=2, max_num_batched_tokens=4096),
        "tp1": dict(chunk_size=args.budget, max_num_batched_tokens=args.budget),
        "tp2": dict(
            tensor_parallel_size=2, chunk_size=args.budget, max_num_batched_tokens=args.budget
        ),
    }
    engines = {name: LLMEngine(EngineConfig(**base, **extra)) for name, extra in shapes.items()}
    steps: dict[str, list[int]] = {name: [] for name in engines}
    busy_ms: dict[str, list[float]] = {name: [] for name in engines}  # per step, per stage
    bubbles: dict[str, list[float]] = {name: [] for name in engines}  # per generate run
    tokens: dict[str, Any] = {}

    def runner(name: str):
        engine = engines[name]

        def run() -> None:
            before = engine._stats.steps
            outputs = engine.generate(prompts, params)
            steps[name].append(engine._stats.steps - before)
            tokens[name] = [o.token_ids for o in outputs]
            if hasattr(engine.runner, "take_timings"):  # this run's worker busy times only
                timings = engine.runner.take_timings()
                busy_ms[name] += [1e3 * (e - s) for stage in timings for _, s, e in stage]
                bubbles[name].append(bubble_fraction(timings))

        return run

    try:
        for name in engines:  # warm-up, and drop its timings
            runner(name)()
            steps[name].clear()
            busy_ms[name].clear()
            bubbles[name].clear()
        times = interleaved({n: runner(n) for n in engines}, args.repeats, log)
        result: dict[str, Any] = {"machine": machine(), "args": vars(args), "engines": {}}
        for name, engine in engines.items():
            entry: dict[str, Any] = {
                "generate_wall_s": round(median(times[name].wall), 4),
                "steps": median(steps[name]),
                "wall_per_step_ms": round(1e3 * median(times[name].wall) / median(steps[name]), 2),
            }
            if busy_ms[name]:
                entry["stage_busy_per_step_ms"] = round(median(busy_ms[name]), 2)
            if engine.config.pipeline_parallel_size > 1:
                entry["bubble_fraction"] = round(median(bubbles[name]), 3)
            entry["same_tokens_as_tp1"] = tokens[name] == tokens["tp1"]
            result["engines"][name] = entry
        emit(result, args.json, args.output)
    finally:
        for engine in engines.values():
            if hasattr(engine.runner, "shutdown"):
                engine.runner.shutdown()
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
