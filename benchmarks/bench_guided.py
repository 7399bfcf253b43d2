"""Guided decoding's per-token cost: the grammar's work in a step against the unconstrained
step, on a full batch of the embedded SmolLM2-135M (issue 29's bar: <= 10%).

Real chat prompts (Alpaca through the chat template), `--num-prompts` (256) at once with
`max_num_seqs` as large, so every decode step samples 256 rows. Two runs per repetition,
interleaved: unconstrained (`ignore_eos`, so all rows run `--max-tokens` steps) and held to a
JSON Schema whose free-text field keeps every row inside the grammar for the whole run
(the order of the two alternates between repetitions). Per
decode step (a step where every row got a token) it times the step, and in the guided run
the grammar's share of it: filling the bitmask and applying it to the logits
(`GuidedDecoder.apply`) plus advancing the matchers (`GuidedDecoder.accept`). Reported: the
medians of the unconstrained and guided decode steps, the grammar's median time per step
and its ratio to the unconstrained step (the bar), and the guided/unconstrained step ratio
(noisier: the runs' tokens differ).

    flock /tmp/raypack-ray.lock python benchmarks/bench_guided.py --output guided.json
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import _bench_common as common
from bench_generate import pool_blocks

from actors import EngineConfig, LLMEngine, SamplingParams, loader
from actors.guided import GuidedDecodingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "summary": {"type": "string"},
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        "topics": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["summary", "sentiment", "confidence", "topics"],
}
BAR = 0.10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--output", help="write the result as JSON to this file")
    return p.parse_args(argv)


class _Clock:
    """Seconds spent in wrapped calls since the last `take`."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - started

        return timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def run(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, clock: _Clock
) -> dict[str, list[float]]:
    """Decode-step times and the grammar's time in each (all rows running)."""
    engine.reset_prefix_cache()
    engine.add_prompts(prompts, params)
    steps, grammar = [], []
    clock.take()
    while engine.has_unfinished():
        started = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - started
        spent = clock.take()
        if len(outputs) == len(prompts) and not any(o.finished for o in outputs):
            steps.append(seconds)
            grammar.append(spent)
    return {"steps": steps, "grammar": grammar}


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print or write its JSON."""
    args = parse_args(argv)
    common.setup_torch(args.threads)
    tokenizer = loader.load_tokenizer("smollm2")
    prompts = common.sample(common.alpaca_prompts(tokenizer), args.num_prompts, args.seed)
    config = EngineConfig(
        max_num_seqs=args.num_prompts,
        num_kv_blocks=pool_blocks(prompts, args.max_tokens),
        max_num_batched_tokens=8192,
    )
    engine = LLMEngine(config, model=loader.load_model("smollm2"), tokenizer=tokenizer)
    clock = _Clock()
    engine.guided.apply = clock.wrap(engine.guided.apply)  # type: ignore[method-assign]
    engine.guided.accept = clock.wrap(engine.guided.accept)  # type: ignore[method-assign]
    cases = {
        "unconstrained": SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
        "json_schema": SamplingParams(
            max_tokens=args.max_tokens, guided_decoding=GuidedDecodingParams(json=SCHEMA)
        ),
    }
    found: dict[str, dict[str, list[float]]] = {
        name: {"steps": [], "grammar": []} for name in cases
    }
    # Untimed: the first run after the engine is built touches the KV pool's pages for the
    # first time (5.7x slower decode steps than the same case run again, measured).
    common.log("warm-up")
    run(engine, prompts, cases["unconstrained"], clock)
    per_run: list[dict[str, Any]] = []  # each run's median step: the machine is shared
    for repeat in range(args.repeats):
        order = list(cases) if repeat % 2 == 0 else list(reversed(cases))
        for name in order:
            common.log(f"repeat {repeat}: {name}")
            timed = run(engine, prompts, cases[name], clock)
            for key, values in timed.items():
                found[name][key].extend(values)
            median = common.median(timed["steps"])
            per_run.append({"case": name, "median_step_s": median, "load": os.getloadavg()[0]})
    base = common.median(found["unconstrained"]["steps"])
    guided = common.median(found["json_schema"]["steps"])
    grammar = common.median(found["json_schema"]["grammar"])
    result = {
        "benchmark": "bench_guided",
        "machine": common.machine(),
        "args": vars(args),
        "decode_steps": {name: len(v["steps"]) for name, v in found.items()},
        "runs": per_run,
        "unconstrained_step_s": base,
        "guided_step_s": guided,
        "grammar_per_step_s": grammar,
        "grammar_per_row_us": grammar / args.num_prompts * 1e6,
        "overhead": grammar / base,
        "step_ratio": guided / base,
        "bar": BAR,
        "meets_bar": grammar / base <= BAR,
    }
    common.emit(result, args.json or not args.output, args.output)


if __name__ == "__main__":
    main()
