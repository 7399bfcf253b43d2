"""End-to-end greedy generation on CPU: HF `generate`, HF `generate_batch`, raypack.

Alpaca prompts (chat template), greedy, `--max-tokens` new tokens, stopping at EOS, timed
interleaved per repetition (medians):

- `hf_generate`: `model.generate` on left-padded batches of `--hf-batch-size`, in input order;
- `hf_generate_batch`: transformers' continuous batching (paged cache, packed prefill);
- `raypack`: `LLMEngine.generate` with many concurrent sequences. One engine is built once
  (its KV pool allocated once, as a serving engine's or a job's engine actor's is) and its
  prefix cache is reset before each repetition (`reset_prefix_cache`, as vLLM benchmarks
  do), so every repetition starts cold; it still shares identical leading KV blocks by block
  hash (the chat template's system prompt) once computed;
- `raypack_grouped`: the same with the planner's prefix groups (`packing.prefix`,
  BatchLLM's first-level grouping, planning time included): each shared prefix once.

Generated tokens count up to and including EOS. Achieved FLOP/s = 2 x parameters x (prompt +
generated tokens) / time, against a large fp32 matmul measured in the same run. Greedy outputs
of raypack are compared with `hf_generate`'s; where they differ, the logit gap of the two
tokens in a solo forward at the first differing token says whether it was a tie.

    python benchmarks/bench_generate.py --json [--num-prompts 256] [--max-tokens 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
from functools import partial
from typing import Any

import _bench_common as common
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from actors import EngineConfig, LLMEngine, SamplingParams, loader
from packing.prefix import group_prefixes

METHODS = ("hf_generate", "hf_generate_batch", "raypack", "raypack_grouped")
TIE_GAP = 1e-3  # top-2 logit gap (SmolLM2 logits are ~10-30) below which argmax is a tie


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    # 64 was HF generate's best of 16/32/64/128 here (128 prompts x 64 tokens, tokens per
    # CPU-second 56/66/69/62): fewer steps than 32, less padding than 128.
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--cb-max-batch-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=256, help="raypack: running sequences")
    # 1024 was raypack's best of 512/1024/2048 here (256 x 64, CPU s 81.3/79.4/79.2 before the
    # decode kernel; 73.4 vs 71.7 with it): whole prompts enter sooner, so fewer small-batch
    # steps at the tail. The engine's default stays 512 for online latency.
    p.add_argument("--budget", type=int, default=1024, help="raypack: max_num_batched_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="1 on a shared box (see bench_prefill)")
    p.add_argument("--no-check", action="store_true", help="skip the greedy comparison")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.add_argument("--output", default=None, help="also write the JSON to this file")
    return p.parse_args(argv)


def trim(tokens: list[int], eos: int) -> list[int]:
    """Generated tokens up to and including the first EOS."""
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


class Generators:
    """The three generators; each call returns generated tokens per prompt (EOS-trimmed)."""

    def __init__(self, args: argparse.Namespace, eos: int, prompts: list[list[int]]) -> None:
        self.args = args
        self.eos = eos
        self.num_kv_blocks = pool_blocks(prompts, args.max_tokens)
        self.tokenizer = loader.load_tokenizer("smollm2")
        # Separate model objects: the engine switches its model's attention implementation.
        self.hf_model = loader.load_model("smollm2", torch.float32, "cpu")
        self.engine_model = loader.load_model("smollm2", torch.float32, "cpu")
        self.hf_model.set_attn_implementation("sdpa")
        self.config = GenerationConfig(  # type: ignore[no-untyped-call]
            max_new_tokens=args.max_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        self.outputs: dict[str, list[list[int]]] = {}
        self._engine: LLMEngine | None = None

    def call(self, method: str, prompts: list[list[int]]) -> None:
        """Generate for every prompt with `method`; keeps the tokens in `outputs`."""
        run = getattr(self, method)
        self.outputs[method] = [trim(list(t), self.eos) for t in run(prompts)]

    @torch.inference_mode()
    def hf_generate(self, prompts: list[list[int]]) -> list[list[int]]:
        out: list[list[int]] = []
        size = self.args.hf_batch_size
        for start in range(0, len(prompts), size):
            batch = prompts[start : start + size]
            width = max(map(len, batch))
            ids = torch.full((len(batch), width), self.eos, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, p in enumerate(batch):  # left padding, as for any decoder-only model
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            gen = self.hf_model.generate(ids, attention_mask=mask, generation_config=self.config)
            out.extend(gen[:, width:].tolist())
        return out

    def hf_generate_batch(self, prompts: list[list[int]]) -> list[list[int]]:
        cb = ContinuousBatchingConfig(
            page_size=16, num_blocks=2048, max_batch_tokens=self.args.cb_max_batch_tokens
        )
        results = self.hf_model.generate_batch(
            prompts, generation_config=self.config, continuous_batching_config=cb
        )
        # Request ids are assigned in input order ("req_0", "req_1", ...).
        by_index = sorted(results.values(), key=lambda r: int(r.request_id.rsplit("_", 1)[-1]))
        return [list(r.generated_tokens) for r in by_index]

    def engine(self) -> LLMEngine:
        """The one raypack engine, built on first use; its prefix cache reset (cold)."""
        if self._engine is None:
            config = EngineConfig(
                max_num_seqs=self.args.max_num_seqs,
                max_num_batched_tokens=self.args.budget,
                num_kv_blocks=self.num_kv_blocks,
            )
            self._engine = LLMEngine(config, model=self.engine_model, tokenizer=self.tokenizer)
        assert self._engine.reset_prefix_cache()
        return self._engine

    def raypack(self, prompts: list[list[int]], grouped: bool = False) -> list[list[int]]:
        engine = self.engine()
        block_size = engine.config.block_size
        groups = group_prefixes(prompts, min_shared=block_size) if grouped else None
        outs = engine.generate(prompts, SamplingParams(max_tokens=self.args.max_tokens), groups)
        return [list(o.token_ids) for o in outs]

    def raypack_grouped(self, prompts: list[list[int]]) -> list[list[int]]:
        return self.raypack(prompts, grouped=True)


def pool_blocks(prompts: list[list[int]], max_tokens: int, block_size: int = 16) -> int:
    """KV blocks for every prompt at once, with room to spare: no preemption in a benchmark."""
    blocks = sum(-(-(len(p) + max_tokens) // block_size) for p in prompts)
    return blocks + blocks // 50 + 16


@torch.inference_mode()
def compare(gens: Generators, prompts: list[list[int]], a: str, b: str) -> dict[str, Any]:
    """Prompts whose greedy tokens differ between methods `a` and `b`, with the gap between
    the two chosen tokens' logits in a solo forward at the first differing token (near 0: a
    floating-point tie that batch shapes may flip either way)."""
    diffs: list[dict[str, Any]] = []
    for i, (x, y) in enumerate(zip(gens.outputs[a], gens.outputs[b], strict=True)):
        if x == y:
            continue
        first = next((j for j, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), None)
        if first is None:  # one stopped earlier with a common prefix: not a token choice
            diffs.append({"prompt": i, "first_diff": min(len(x), len(y)), "gap": None})
            continue
        logits = gens.hf_model(torch.tensor([prompts[i] + x[:first]])).logits[0, -1]
        gap = abs(float(logits[x[first]] - logits[y[first]]))
        diffs.append({"prompt": i, "first_diff": first, "gap": gap, "tie": gap < TIE_GAP})
    return {
        "compared": len(prompts),
        "identical": len(prompts) - len(diffs),
        "mismatches": len(diffs),
        "ties": sum(1 for d in diffs if d.get("tie")),
        "details": diffs,
    }


def bar(methods: dict[str, Any], clock: str) -> dict[str, Any]:
    """Issue 3's bar: raypack >= 3x HF generate's tokens/s and faster than generate_batch."""
    rates = {m: r[f"generated_tokens_per_s_{clock}"] for m, r in methods.items()}
    out: dict[str, Any] = {}
    for ours in ("raypack", "raypack_grouped"):
        if ours not in rates:
            continue
        entry: dict[str, Any] = {}
        if "hf_generate" in rates:
            entry["speedup_vs_hf_generate"] = rates[ours] / rates["hf_generate"]
            entry["meets_3x_hf_generate"] = entry["speedup_vs_hf_generate"] >= 3.0
        if "hf_generate_batch" in rates:
            entry["speedup_vs_generate_batch"] = rates[ours] / rates["hf_generate_batch"]
            entry["faster_than_generate_batch"] = entry["speedup_vs_generate_batch"] > 1.0
        out[ours] = entry
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns (and prints with --json) the result."""
    args = parse_args(argv)
    common.setup_torch(args.threads)
    tokenizer = loader.load_tokenizer("smollm2")
    eos = int(tokenizer.eos_token_id)
    prompts = common.sample(common.alpaca_prompts(tokenizer), args.num_prompts, args.seed)
    gens = Generators(args, eos, prompts)
    params = sum(p.numel() for p in gens.hf_model.parameters())
    probe = common.MatmulProbe()
    for method in args.methods:  # warm-up: first-call costs out of the timings
        gens.call(method, prompts[:4])
    common.log(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens")
    timed: dict[str, Any] = {m: partial(gens.call, m, prompts) for m in args.methods}
    timed["matmul_probe"] = probe  # the peak, measured between the methods
    times = common.interleaved(timed, args.repeats, common.log)
    prompt_tokens = sum(map(len, prompts))
    result: dict[str, Any] = {
        "benchmark": "generate",
        "machine": common.machine(),
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "output")},
        "num_prompts": len(prompts),
        "prompt_tokens": prompt_tokens,
        "params": params,
        "matmul_peak_gflops": {c: probe.flops(c) / 1e9 for c in ("wall", "cpu")},
        "matmul_samples_gflops": {
            c: [round(f / 1e9, 1) for f in v] for c, v in probe.samples.items()
        },
        "methods": {},
    }
    for m in args.methods:
        generated = sum(map(len, gens.outputs[m]))
        entry = {"generated_tokens": generated, **times[m].summary()}
        for clock in ("wall", "cpu"):
            seconds = common.median(getattr(times[m], clock))
            flops = 2 * params * (prompt_tokens + generated) / seconds
            entry[f"generated_tokens_per_s_{clock}"] = generated / seconds
            entry[f"achieved_gflops_{clock}"] = flops / 1e9
            entry[f"fraction_of_matmul_peak_{clock}"] = flops / probe.flops(clock)
        result["methods"][m] = entry
    result["bar"] = {clock: bar(result["methods"], clock) for clock in ("wall", "cpu")}
    if not args.no_check:
        result["greedy_check"] = {
            f"{ours}_vs_{m}": compare(gens, prompts, ours, m)
            for ours in ("raypack", "raypack_grouped")
            for m in ("hf_generate", "hf_generate_batch")
            if ours in gens.outputs and m in gens.outputs
        }
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    common.log(f"bar: {result['bar']}")
    common.emit(result, args.json, args.output)
    return result


if __name__ == "__main__":
    main()
