"""bfloat16 against float32 on CPU, the engine alone: speed and agreement.

Real chat prompts (Alpaca through the chat template, or `--dataset hh`), greedy, up to
`--max-tokens` new tokens, stopping at EOS. One `LLMEngine` per dtype over the embedded
SmolLM2-135M (fp32 weights, and the same weights cast to bf16), each built once, its prefix
cache reset before every run (as bench_generate.py does; the block-hash cache still shares
the chat template's leading blocks within a run, alike in both dtypes).

- speed (`--parts speed`): generation (`max_tokens` new tokens) and prefill (one new token:
  the run is the prompts' prefill plus one sampling step), timed interleaved over the two
  dtypes, medians of `--repeats`; generated tokens/s and prompt tokens/s, bf16 / fp32
  ratios against issue 16's bar (generation >= 1.6x, prefill >= 1.8x).
- agreement (`--parts agreement`): the fp32 engine's greedy continuations are the targets;
  both engines are teacher-forced on them (`actors.agreement`): top-1 agreement of bf16
  with fp32 and the mean |delta logprob| of the target tokens; also free-running greedy
  (identical sequences, equal first tokens).

Run the speed part under the shared timing lock:

    flock /tmp/raypack-ray.lock python benchmarks/bench_bf16.py --parts speed --output s.json
    python benchmarks/bench_bf16.py --parts agreement --output a.json
"""

from __future__ import annotations

import argparse
import os
from functools import partial
from typing import Any

import _bench_common as common
import torch
from bench_generate import pool_blocks

from actors import EngineConfig, LLMEngine, SamplingParams, loader
from actors.agreement import agreement, teacher_forced

DTYPES = ("float32", "bfloat16")
BAR = {"generation": 1.6, "prefill": 1.8}  # issue 16: bf16 / fp32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", choices=common.DATASETS, default="alpaca")
    p.add_argument("--num-prompts", type=int, default=175)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--parts", nargs="+", choices=("speed", "agreement"), default=["speed"])
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--budget", type=int, default=1024, help="max_num_batched_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine: 2)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.add_argument("--output", default=None, help="also write the JSON to this file")
    return p.parse_args(argv)


class Engines:
    """One engine per dtype over the same weights; `run` generates from a cold prefix cache."""

    def __init__(self, args: argparse.Namespace, prompts: list[list[int]]) -> None:
        tokenizer = loader.load_tokenizer("smollm2")
        blocks = pool_blocks(prompts, args.max_tokens)
        self.engines: dict[str, LLMEngine] = {}
        for dtype in DTYPES:
            config = EngineConfig(
                dtype=dtype,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.budget,
                num_kv_blocks=blocks,
            )
            model = loader.load_model("smollm2", getattr(torch, dtype), "cpu")
            self.engines[dtype] = LLMEngine(config, model=model, tokenizer=tokenizer)
        self.outputs: dict[str, list[list[int]]] = {}

    def run(self, dtype: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        engine = self.engines[dtype]
        assert engine.reset_prefix_cache()
        outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
        tokens = [list(o.token_ids) for o in outs]
        self.outputs[f"{dtype}_{max_tokens}"] = tokens
        return tokens


def speed(args: argparse.Namespace, engines: Engines, prompts: list[list[int]]) -> dict[str, Any]:
    """Generation and prefill of both dtypes, interleaved; rates and bf16 / fp32 ratios."""
    timed = {}
    for dtype in DTYPES:
        timed[f"generation_{dtype}"] = partial(engines.run, dtype, prompts, args.max_tokens)
        timed[f"prefill_{dtype}"] = partial(engines.run, dtype, prompts, 1)
    times = common.interleaved(timed, args.repeats, common.log)
    prompt_tokens = sum(map(len, prompts))
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "runs": {}}
    rates: dict[str, dict[str, float]] = {"generation": {}, "prefill": {}}
    for dtype in DTYPES:
        generated = sum(map(len, engines.outputs[f"{dtype}_{args.max_tokens}"]))
        for part, tokens in (("generation", generated), ("prefill", prompt_tokens)):
            t = times[f"{part}_{dtype}"]
            out["runs"][f"{part}_{dtype}"] = {"tokens": tokens, **t.summary()}
            rates[part][dtype] = tokens / common.median(t.wall)
    out["tokens_per_s"] = rates
    out["bf16_over_fp32"] = {p: r["bfloat16"] / r["float32"] for p, r in rates.items()}
    out["meets_bar"] = {p: out["bf16_over_fp32"][p] >= BAR[p] for p in BAR}
    out["bar"] = BAR
    return out


def free_running(ref: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """Greedy sequences of both dtypes, each on its own: how many are identical."""
    return {
        "sequences": len(ref),
        "identical": sum(a == b for a, b in zip(ref, other, strict=True)),
        "first_token_equal": sum(a[:1] == b[:1] for a, b in zip(ref, other, strict=True)),
    }


def agreement_part(
    args: argparse.Namespace, engines: Engines, prompts: list[list[int]]
) -> dict[str, Any]:
    """Teacher-forced agreement of bf16 with fp32 on fp32's greedy continuations."""
    targets = engines.run("float32", prompts, args.max_tokens)
    bf16 = engines.run("bfloat16", prompts, args.max_tokens)
    forced = {}
    for dtype in DTYPES:
        assert engines.engines[dtype].reset_prefix_cache()
        forced[dtype] = teacher_forced(engines.engines[dtype], prompts, targets)
        common.log(f"teacher-forced {dtype}")
    return {
        "teacher_forced": agreement(forced["float32"], forced["bfloat16"], targets),
        "free_running": free_running(targets, bf16),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns (and prints with --json) the result."""
    args = parse_args(argv)
    common.setup_torch(args.threads)
    tokenizer = loader.load_tokenizer("smollm2")
    prompts = common.sample(
        common.load_prompts(args.dataset, tokenizer), args.num_prompts, args.seed
    )
    engines = Engines(args, prompts)
    for dtype in DTYPES:  # warm-up: first-call costs (kernel build, allocator) out of timings
        engines.run(dtype, prompts[:4], 8)
    common.log(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens")
    result: dict[str, Any] = {
        "benchmark": "bf16",
        "machine": common.machine(),
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "output")},
        "num_prompts": len(prompts),
        "attention_backend": {
            d: type(e.runner.attention_backend.decode).__name__  # type: ignore[attr-defined]
            for d, e in engines.engines.items()
        },
    }
    if "speed" in args.parts:
        result["speed"] = speed(args, engines, prompts)
        common.log(f"speed: {result['speed']['bf16_over_fp32']}")
    if "agreement" in args.parts:
        result["agreement"] = agreement_part(args, engines, prompts)
        common.log(f"agreement: {result['agreement']}")
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    common.emit(result, args.json, args.output)
    return result


if __name__ == "__main__":
    main()
