"""Shared-prefix decode attention (issue 16): decode-heavy workloads where several questions
share one long document, with the backend on and off, and with prefix groups off.

A workload is `docs` documents of `doc_tokens` tokens (HH-RLHF dialogues, a different slice
each), each followed by `questions` Alpaca instructions ("Question: ...\\nAnswer:"), and
`max_tokens` new tokens per prompt (EOS ignored, so every method decodes the same count).
Methods, each on its own engine over the same model:
- `on`: one prefix group per document, `shared_prefix_attention` on (every shared run read
  apart: `shared_prefix_min_keys=1`, the grid's smallest runs included);
- `off`: the same groups, the backend off (the C kernel reads the document once per question);
- `no_groups`: no prefix groups (the block-hash prefix cache still shares the document's full
  blocks once its first prompt computed them), default config.

Per method: generated tokens/s over the whole run, decode tokens/s and the median decode step
time over the steps that only decode (tokens scheduled == tokens sampled), wall and CPU clocks;
tokens must be identical across methods. Methods interleave with a rotating order
(`_bench_common.interleaved`'s reasoning); medians over `--repeats`.

One run: the full grid (1/2/4 documents x 500/1,000/2,000 tokens x 8/16/32 questions) on the
tests' tiny random llama (2 layers, 4 heads, 2 KV heads, head_dim 16; SmolLM2 is too slow for a
grid of 27 cells x 3 methods here), and the issue's bar cell (1 document of 1,000 tokens, 16
questions) on the embedded SmolLM2-135M. With `--lock` each cell holds that file's lock
(`flock`) while it runs, so a run shares the machine's timing lock in pieces of < 5 minutes.

    python benchmarks/bench_shared_prefix.py --lock /tmp/raypack-ray.lock \\
        --output docs/shared_prefix.json --plot docs/shared_prefix.png
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _bench_common as common
import numpy as np
import torch
from _bench_common import ALPACA_FILE, DATA_DIR, HH_FILE, held

from actors import EngineConfig, LLMEngine, SamplingParams, loader
from packing.prefix import PrefixGroup

METHODS = ("on", "off", "no_groups")
GRID_DOCS = (1, 2, 4)
GRID_DOC_TOKENS = (500, 1000, 2000)
GRID_QUESTIONS = (8, 16, 32)
BAR = (1, 1000, 16)  # docs, doc tokens, questions: the bar cell
BAR_SPEEDUP = 1.5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-grid", action="store_true", help="the SmolLM2 bar cell only")
    p.add_argument("--no-smollm2", action="store_true", help="the tiny-model grid only")
    p.add_argument("--no-tiny", action="store_true", help="no engine grid on the tiny model")
    p.add_argument("--lock", default=None, help="flock this file around each cell")
    p.add_argument("--output", default=None, help="write the JSON here")
    p.add_argument("--plot", default=None, help="write the plot (PNG) here")
    return p.parse_args(argv)


def workload(tokenizer: Any, docs: int, doc_tokens: int, questions: int) -> tuple[list, list]:
    """Prompts (token ids, document by document) and one prefix group per document."""
    with gzip.open(DATA_DIR / HH_FILE, "rt") as f:
        texts = [json.loads(line)["chosen"] for line in f if line.strip()]
    with open(DATA_DIR / ALPACA_FILE) as f:
        instructions = [r["instruction"] for r in json.load(f)]
    prompts: list[list[int]] = []
    groups: list[PrefixGroup] = []
    for d in range(docs):
        doc = tokenizer.encode(
            "\n\n".join(texts[200 * d : 200 * d + 150]), add_special_tokens=False
        )
        assert len(doc) >= doc_tokens, "the dialogues are shorter than the document asked for"
        doc = doc[:doc_tokens]
        start = len(prompts)
        for q in range(questions):
            text = f"\n\nQuestion: {instructions[d * 64 + q]}\nAnswer:"
            prompts.append(doc + tokenizer.encode(text, add_special_tokens=False))
        groups.append(PrefixGroup(prefix_len=doc_tokens, members=tuple(range(start, len(prompts)))))
    return prompts, groups


def kv_blocks(prompts: list[list[int]], max_tokens: int, block_size: int = 16) -> int:
    """Blocks for every prompt at once without sharing: no preemption in any method."""
    return sum(-(-(len(p) + max_tokens) // block_size) for p in prompts) + 64


def run_once(engine: LLMEngine, prompts, groups, max_tokens: int) -> dict[str, Any]:
    """One generation, step by step: its tokens and timings."""
    engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = engine.add_prompts(prompts, params, groups)
    tokens: dict[str, list[int]] = {}
    decode_steps: list[tuple[float, int]] = []
    before = engine.stats.num_scheduled_tokens
    wall, cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        start = time.perf_counter()
        outs = engine.step()
        seconds = time.perf_counter() - start
        after = engine.stats.num_scheduled_tokens
        if outs and after - before == len(outs):  # every scheduled token was a decode
            decode_steps.append((seconds, len(outs)))
        before = after
        for out in outs:
            if out.finished:
                assert out.error is None, out.error
                tokens[out.request_id] = list(out.token_ids)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    generated = sum(len(t) for t in tokens.values())
    decode_s = sum(s for s, _ in decode_steps)
    return {
        "tokens": [tokens[i] for i in ids],
        "wall_s": wall,
        "cpu_s": cpu,
        "generated_tokens_per_s": generated / wall,
        "decode_tokens_per_s": sum(n for _, n in decode_steps) / max(decode_s, 1e-9),
        "decode_step_ms_median": 1e3 * statistics.median(s for s, _ in decode_steps),
        "decode_steps": len(decode_steps),
    }


def cell(model: Any, tokenizer: Any, shape: tuple[int, int, int], args) -> dict[str, Any]:
    """Every method on one workload, interleaved `--repeats` times."""
    prompts, groups = workload(tokenizer, *shape)
    blocks = kv_blocks(prompts, args.max_tokens)
    configs = {
        "on": EngineConfig(num_kv_blocks=blocks, shared_prefix_min_keys=1),
        "off": EngineConfig(num_kv_blocks=blocks, shared_prefix_attention=False),
        "no_groups": EngineConfig(num_kv_blocks=blocks),
    }
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    with held(args.lock):
        engines = {m: LLMEngine(c, model=model, tokenizer=tokenizer) for m, c in configs.items()}
        for rep in range(args.repeats):
            order = METHODS[rep % 3 :] + METHODS[: rep % 3]
            for m in order:
                runs[m].append(
                    run_once(
                        engines[m], prompts, None if m == "no_groups" else groups, args.max_tokens
                    )
                )
        del engines
    reference = runs["off"][0]["tokens"]
    result: dict[str, Any] = {"docs": shape[0], "doc_tokens": shape[1], "questions": shape[2]}
    for m in METHODS:
        keys = (
            "wall_s",
            "cpu_s",
            "generated_tokens_per_s",
            "decode_tokens_per_s",
            "decode_step_ms_median",
        )
        result[m] = {k: statistics.median(r[k] for r in runs[m]) for k in keys}
        result[m]["runs_wall_s"] = [round(r["wall_s"], 3) for r in runs[m]]
        result[m]["runs_cpu_s"] = [round(r["cpu_s"], 3) for r in runs[m]]
        result[m]["identical_to_off"] = all(r["tokens"] == reference for r in runs[m])
    result["decode_speedup_on_vs_off"] = (
        result["on"]["decode_tokens_per_s"] / result["off"]["decode_tokens_per_s"]
    )
    # Median step against median step: a few stalled steps (other processes on the box)
    # move decode tokens/s (a sum over the steps) but not this.
    result["decode_step_speedup_on_vs_off"] = (
        result["off"]["decode_step_ms_median"] / result["on"]["decode_step_ms_median"]
    )
    result["speedup_on_vs_off"] = result["off"]["wall_s"] / result["on"]["wall_s"]
    result["speedup_on_vs_no_groups"] = result["no_groups"]["wall_s"] / result["on"]["wall_s"]
    print(json.dumps({k: v for k, v in result.items()}, default=float), file=sys.stderr)
    return result


SMOLLM2_ATTENTION = (9, 3, 64)  # heads, kv heads, head_dim of SmolLM2-135M


def attention_cell(shape: tuple[int, int, int], max_tokens: int, repeats: int = 20) -> dict:
    """One layer's decode attention alone (no model), SmolLM2's head shapes, mid-generation
    (each question's own keys: ~24 prompt tokens and half the new ones): the shared-prefix
    backend against the plain kernel, per-call medians (interleaved)."""
    from actors.attention import StepBatch, make_backend
    from packing.layout import flat_layout

    docs, doc_tokens, questions = shape
    heads, kv_heads, dim = SMOLLM2_ATTENTION
    block = 16
    own = 24 + max_tokens // 2
    doc_blocks, own_blocks = -(-doc_tokens // block), -(-(own + 1) // block)
    n = docs * questions
    total = docs * doc_blocks + n * own_blocks
    caches = [(torch.randn(total, block, kv_heads, dim), torch.randn(total, block, kv_heads, dim))]
    tables = []
    for d in range(docs):
        prefix = list(range(d * doc_blocks, (d + 1) * doc_blocks))
        for q in range(questions):
            first = docs * doc_blocks + (d * questions + q) * own_blocks
            tables.append(prefix + list(range(first, first + own_blocks)))
    # A document's last block is shared only when full: round its tokens down to blocks.
    cached = np.full(n, (doc_tokens // block) * block + own, dtype=np.int64)
    new = np.ones(n, dtype=np.int64)
    batch = StepBatch(cached, new, tables, flat_layout(cached, new).cu_seqlens_q, n, block)
    query = torch.randn(1, heads, n, dim)
    out = torch.empty(n, heads, dim)
    backends = {
        "on": make_backend("cpu_kernel", caches, True, 1).decode,  # type: ignore[attr-defined]
        "off": make_backend("cpu_kernel", caches, False).decode,  # type: ignore[attr-defined]
    }
    metas = {m: b.prepare(batch) for m, b in backends.items()}
    times: dict[str, list[float]] = {"on": [], "off": []}
    for rep in range(repeats + 2):
        for m in ("on", "off") if rep % 2 else ("off", "on"):
            start = time.perf_counter()
            backends[m].forward(metas[m], 0, query, None, None, dim**-0.5, out)
            if rep >= 2:  # two warm-up calls each
                times[m].append(time.perf_counter() - start)
    result = {m: 1e6 * statistics.median(t) for m, t in times.items()}
    return {
        "docs": docs,
        "doc_tokens": doc_tokens,
        "questions": questions,
        "on_us_per_layer": result["on"],
        "off_us_per_layer": result["off"],
        "speedup": result["off"] / result["on"],
    }


def plot(result: dict[str, Any], path: str) -> None:
    """Speedups per grid cell (attention alone on SmolLM2's shapes; the tiny engine) and the
    SmolLM2 bar cell's decode tokens/s per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (key, field, title)
        for key, field, title in (
            ("attention_smollm2_shapes", "speedup", "one layer's decode attention, SmolLM2 shapes"),
            ("grid", "decode_speedup_on_vs_off", "tiny llama engine (2 layers): decode tokens/s"),
        )
        if result.get(key)
    ]
    bar = result.get("smollm2_bar")
    widths = [4] * len(panels) + ([1.3] if bar else [])
    fig, axes = plt.subplots(1, len(widths), figsize=(4 * sum(widths) / 1.3, 4.5), squeeze=False)
    for ax, (key, field, title) in zip(axes[0], panels, strict=False):
        cells = result[key]
        labels = [f"{c['docs']}x{c['doc_tokens']}\n{c['questions']}q" for c in cells]
        ax.bar(range(len(cells)), [c[field] for c in cells], color="C2")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(cells)), labels, fontsize=5)
        ax.set_ylabel("on / off")
        ax.set_title(title + " (docs x tokens, questions each)", fontsize=9)
    if bar:
        last = axes[0][-1]
        last.bar(METHODS, [bar[m]["decode_tokens_per_s"] for m in METHODS], color="C0")
        last.set_ylabel("decode tokens/s")
        last.set_title(
            f"SmolLM2-135M, 1 x 1,000, 16 q\non / off {bar['decode_speedup_on_vs_off']:.2f}x",
            fontsize=9,
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    common.setup_torch(args.threads)
    tokenizer = loader.load_tokenizer("smollm2")
    result: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "threads": args.threads,
    }
    if not args.no_grid:
        with held(args.lock):
            result["attention_smollm2_shapes"] = [
                attention_cell((d, n, q), args.max_tokens)
                for d in GRID_DOCS
                for n in GRID_DOC_TOKENS
                for q in GRID_QUESTIONS
            ]

    if not args.no_grid and not args.no_tiny:
        from tests.tiny_models import tiny_model

        model = tiny_model("llama", max_position_embeddings=4096)
        result["grid"] = [
            cell(model, tokenizer, (d, n, q), args)
            for d in GRID_DOCS
            for n in GRID_DOC_TOKENS
            for q in GRID_QUESTIONS
        ]
    if not args.no_smollm2:
        model = loader.load_model("smollm2", torch.float32, "cpu")
        bar = cell(model, tokenizer, BAR, args)
        bar["meets_bar"] = (
            min(bar["decode_speedup_on_vs_off"], bar["decode_step_speedup_on_vs_off"])
            >= BAR_SPEEDUP
            and bar["on"]["identical_to_off"]
        )
        result["smollm2_bar"] = bar
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1, default=float) + "\n")
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
