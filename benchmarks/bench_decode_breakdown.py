"""Where a decode step's time goes on issue 16's shared-prefix workloads, and the ceiling that
puts on any decode attention backend.

The workload is `bench_shared_prefix.workload` (one prefix group per document, `--max-tokens`
new tokens, EOS ignored). Methods, each on its own engine over the same model, interleaved
with a rotating order, medians over `--repeats`:
- `on`: the shared-prefix backend (`shared_prefix_min_keys=1`);
- `off`: the plain C kernel (each decode reads the document);
- `noop`: `off` with the decode attention replaced by writing zeros: the rest of the step (the
  weights' matmuls, norms, rotary, the KV write, sampling, scheduling) alone, a lower bound of
  any backend's step (its tokens differ; the step count does not, EOS being ignored).
In `on` and `off` the decode backend's `forward` is timed per step (perf_counter, all layers),
and for `on` its kernel calls (each decode's own keys) apart from the rest (the shared runs'
flash calls and merges). Per decode-only step (tokens scheduled == tokens sampled): the
step's wall time, the decode attention's, and their medians.

The ceiling: if the document's keys cost nothing, a step takes at least
`step_off - attention_off + own_keys_on` (the plain step without its decode attention, plus
the kernel over each decode's own keys, as `on` runs it); `step_off / that` is the best speedup
any shared-prefix backend can reach. `--profile` adds one torch.profiler pass over 16 decode
steps of `off` and `on`: the self CPU time of the matmul ops, the decode attention and the rest.

    python benchmarks/bench_decode_breakdown.py --lock /tmp/raypack-ray.lock \\
        --output docs/decode_breakdown.json --profile
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _bench_common as common
import torch
from _bench_common import held
from bench_shared_prefix import workload

from actors import EngineConfig, LLMEngine, SamplingParams, loader

METHODS = ("on", "off", "noop")
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")


class Timer:
    """Wraps a callable and adds up its perf_counter seconds (per step: `take`)."""

    def __init__(self, fn: Any, label: str) -> None:
        self.fn, self.label, self.seconds = fn, label, 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        with torch.profiler.record_function(self.label):
            result = self.fn(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        return result

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class TimedKernel:
    """A `PagedDecode` whose `run` (what the backends call) is timed."""

    def __init__(self, kernel: Any) -> None:
        self.dtype = kernel.dtype
        self.run = Timer(kernel.run, "decode_kernel")


def instrument(engine: LLMEngine, method: str) -> dict[str, Timer]:
    """Time the engine's decode backend (and, for `on`, its kernel); for `noop` replace its
    forward by zeros."""
    decode = engine.runner.attention_backend.decode  # type: ignore[attr-defined]
    timers = {"attention": Timer(decode.forward, "decode_attention")}
    if method == "noop":

        def zeros(
            meta: Any, layer: int, query: Any, key: Any, value: Any, s: Any, out: Any
        ) -> None:
            out[meta.first_row : meta.first_row + len(meta.seq_lens)].zero_()

        timers["attention"] = Timer(zeros, "decode_attention")
    decode.forward = timers["attention"]
    if method == "on":
        decode.kernel = TimedKernel(decode.kernel)
        timers["own_keys"] = decode.kernel.run
    return timers


def run_once(
    engine: LLMEngine,
    timers: dict[str, Timer],
    prompts: list[list[int]],
    groups: list[Any],
    max_tokens: int,
    profile: bool = False,
) -> dict[str, Any]:
    """One generation step by step: per decode-only step its wall time and the timers'."""
    engine.reset_prefix_cache()
    ids = engine.add_prompts(
        prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), groups
    )
    steps: list[dict[str, float]] = []
    tokens: dict[str, list[int]] = {}
    before = engine.stats.num_scheduled_tokens
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    profiled = 0
    while engine.has_unfinished():
        if profile and len(steps) == 32 and not profiled:
            prof.start()
        start = time.perf_counter()
        outs = engine.step()
        seconds = time.perf_counter() - start
        parts = {name: t.take() for name, t in timers.items()}
        after = engine.stats.num_scheduled_tokens
        if outs and after - before == len(outs):
            steps.append({"step": seconds, **parts})
            if profile and len(steps) > 32 and profiled < 16:
                profiled += 1
                if profiled == 16:
                    prof.stop()
        before = after
        for out in outs:
            if out.finished:
                assert out.error is None, out.error
                tokens[out.request_id] = list(out.token_ids)
    if profile and 0 < profiled < 16:
        prof.stop()
    result: dict[str, Any] = {
        "tokens": [tokens[i] for i in ids],
        "decode_steps": len(steps),
        **{f"{k}_ms_median": 1e3 * statistics.median(s[k] for s in steps) for k in steps[0]},
        **{f"{k}_s_total": sum(s[k] for s in steps) for k in steps[0]},
    }
    if profile:
        result["profile"] = split_profile(prof, profiled)
    return result


def split_profile(prof: Any, steps: int) -> dict[str, float]:
    """Self CPU ms per step: matmul ops, the decode attention (its record_function, total),
    everything else recorded."""
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e3 / steps
    matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS) / 1e3 / steps
    attention = sum(e.cpu_time_total for e in events if e.key == "decode_attention") / 1e3 / steps
    return {
        "recorded_ms_per_step": total,
        "matmul_ms_per_step": matmul,
        "decode_attention_ms_per_step": attention,
        "other_ms_per_step": total - matmul - attention,
    }


def cell(
    model: Any, tokenizer: Any, shape: tuple[int, int, int], args: argparse.Namespace
) -> dict[str, Any]:
    """The three methods on one workload, interleaved; medians and the ceiling."""
    prompts, groups = workload(tokenizer, *shape)
    block = 16
    # Enough blocks for the shared documents once plus every question's own part, twice over.
    own = sum(-(-(len(p) - shape[1] + args.max_tokens) // block) + 1 for p in prompts)
    blocks = 2 * (shape[0] * -(-shape[1] // block) + own) + 64
    configs = {
        "on": EngineConfig(num_kv_blocks=blocks, shared_prefix_min_keys=1),
        "off": EngineConfig(num_kv_blocks=blocks, shared_prefix_attention=False),
        "noop": EngineConfig(num_kv_blocks=blocks, shared_prefix_attention=False),
    }
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    load = []
    with held(args.lock):
        load.append(Path("/proc/loadavg").read_text().split()[:3])
        engines = {m: LLMEngine(c, model=model, tokenizer=tokenizer) for m, c in configs.items()}
        timers = {m: instrument(e, m) for m, e in engines.items()}
        for rep in range(args.repeats):
            for m in METHODS[rep % 3 :] + METHODS[: rep % 3]:
                runs[m].append(run_once(engines[m], timers[m], prompts, groups, args.max_tokens))
        if args.profile:
            for m in ("off", "on"):
                runs[m].append(
                    run_once(engines[m], timers[m], prompts, groups, args.max_tokens, True)
                )
        load.append(Path("/proc/loadavg").read_text().split()[:3])
        del engines
    out: dict[str, Any] = {"docs": shape[0], "doc_tokens": shape[1], "questions": shape[2]}
    out["loadavg_before_after"] = load
    reference = runs["off"][0]["tokens"]
    for m in METHODS:
        timed = runs[m][: args.repeats]
        keys = [k for k in timed[0] if k.endswith(("_ms_median", "_s_total"))]
        out[m] = {k: statistics.median(r[k] for r in timed) for k in keys}
        out[m]["runs_step_ms_median"] = [round(r["step_ms_median"], 2) for r in timed]
        out[m]["identical_to_off"] = all(r["tokens"] == reference for r in timed)
        if args.profile and m != "noop":
            out[m]["profile"] = runs[m][-1]["profile"]
    step_off, attn_off = out["off"]["step_ms_median"], out["off"]["attention_ms_median"]
    own_on = out["on"]["own_keys_ms_median"]
    out["attention_share_off"] = attn_off / step_off
    out["ceiling_free_document"] = step_off / (step_off - attn_off + own_on)
    out["ceiling_free_attention"] = step_off / (step_off - attn_off)
    out["ceiling_noop"] = step_off / out["noop"]["step_ms_median"]
    out["speedup_on_vs_off"] = step_off / out["on"]["step_ms_median"]
    out["attention_speedup_on_vs_off"] = attn_off / out["on"]["attention_ms_median"]
    print(json.dumps(out, default=float), file=sys.stderr)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--cells", default="1x1000x16", help="docs x doc tokens x questions, comma-separated"
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="a torch.profiler pass per cell")
    p.add_argument("--lock", default=None, help="flock this file around each cell")
    p.add_argument("--output", default=None, help="write the JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    common.setup_torch(args.threads)
    tokenizer = loader.load_tokenizer("smollm2")
    model = loader.load_model("smollm2", torch.float32, "cpu")
    shapes = [tuple(int(x) for x in c.split("x")) for c in args.cells.split(",")]
    result: dict[str, Any] = {
        "model": "smollm2 fp32",
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "threads": args.threads,
        "cells": [cell(model, tokenizer, s, args) for s in shapes],  # type: ignore[arg-type]
    }
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1, default=float) + "\n")
    return result


if __name__ == "__main__":
    main()
