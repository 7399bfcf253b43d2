"""Engine steps of one set of prompts admitted in different orders, on their real output lengths.

How many steps the engine takes for the same prompts depends on the order they enter it (at
most `max_num_seqs` run at once, one token budget per step): `benchmarks/bench_job.py` shows
the job taking 153 steps where the engine alone takes 145. This counts the steps of each order
without the model's cost: the embedded SmolLM2 generates once (greedy, in the Alpaca order, as
`bench_job.py`'s engine alone) to learn each prompt's output length, then a tiny random model of
the same vocabulary runs every order with each prompt's `max_tokens` set to that length and
`ignore_eos` and the real engine's count of KV blocks, so each schedule is the real one
(preemptions included). A fresh engine per order (no prefix cache carried over).

    python benchmarks/order_steps.py --num-prompts 512 --max-tokens 64 [--dataset hh] \
        --json orders.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from actors import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from benchmarks._pipeline_workloads import hh_rows  # noqa: E402
from benchmarks.bench_job import alpaca_messages, prompt_ids  # noqa: E402
from packing import PrefixGroup  # noqa: E402
from pipeline.config import PlanConfig  # noqa: E402
from pipeline.stages import stage  # noqa: E402
from pipeline.stages.group_columns import read_groups  # noqa: E402
from pipeline.stages.plan import plan_partition  # noqa: E402
from tests.pipeline.test_plan_infer import tokenized  # noqa: E402
from tests.tiny_models import save_tiny_model  # noqa: E402

Batch = tuple[list[int], list[PrefixGroup]]  # prompt indices, their groups (over the batch)


def count_steps(
    model: str, prompts: list, lengths: list[int], batches: list[Batch], num_kv_blocks: int
) -> int:
    """Steps of a fresh engine with `num_kv_blocks` KV blocks given `batches` (each one
    `add_prompts` call) before its first step, every prompt generating exactly its `lengths`
    tokens."""
    engine = LLMEngine(EngineConfig(model=model, num_kv_blocks=num_kv_blocks))
    for rows, groups in batches:
        params = [SamplingParams(max_tokens=max(1, lengths[r]), ignore_eos=True) for r in rows]
        engine.add_prompts([prompts[r] for r in rows], params, groups)
    while engine.has_unfinished():
        engine.step()
    return engine.stats.num_steps


def orders(prompts: list, lengths: list[int], shard_size: int, max_tokens: int) -> dict:
    """The orders compared: name -> batches."""
    ids = [str(i) for i in range(len(prompts))]
    table = tokenized([(rid, p, None) for rid, p in zip(ids, prompts, strict=True)])
    shards, _ = plan_partition(
        table, PlanConfig(max_rows_per_shard=shard_size), SamplingParams(max_tokens=max_tokens), []
    )
    plan = [
        ([int(i) for i in shards.column(stage.ID)[r].as_py()], list(read_groups(shards, r).engine))
        for r in range(shards.num_rows)
    ]
    everything = list(range(len(prompts)))
    shuffled = everything[:]
    random.Random(1).shuffle(shuffled)
    inside = [random.Random(2).sample(rows, len(rows)) for rows, _ in plan]  # each shard mixed
    longest = max(len(rows) for rows, _ in plan)
    round_robin = [rows[k] for k in range(longest) for rows, _ in plan if k < len(rows)]
    return {
        "input order, one call (the engine alone)": [(everything, [])],
        f"plan order, {shard_size}-row shards with their groups (the job)": plan,
        f"plan order, {shard_size}-row shards, no groups": [(rows, []) for rows, _ in plan],
        "plan order, shards reversed": plan[::-1],
        "plan's shards, each shard's rows in a random order, no groups": [(r, []) for r in inside],
        "plan's shards taken in turn, a row from each, no groups": [(round_robin, [])],
        "a random order": [(shuffled, [])],
        "shortest prompt first": [(sorted(everything, key=lambda r: len(prompts[r])), [])],
        "longest prompt first": [(sorted(everything, key=lambda r: -len(prompts[r])), [])],
        "longest output first (an oracle)": [(sorted(everything, key=lambda r: -lengths[r]), [])],
        "shortest output first": [(sorted(everything, key=lambda r: lengths[r]), [])],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--shard-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dataset",
        choices=("alpaca", "hh"),
        default="alpaca",
        help="alpaca: chat-templated instructions (bench_job.py's); hh: HH-RLHF transcripts as "
        "text, a chosen and a rejected row per dialogue (they share the dialogue's prefix)",
    )
    parser.add_argument(
        "--max-prompt-tokens", type=int, default=256, help="hh: dialogues whose rows fit this"
    )
    parser.add_argument("--json", help="write the report to this file (too)")
    args = parser.parse_args(argv)

    real = LLMEngine(EngineConfig())
    if args.dataset == "alpaca":
        rows = alpaca_messages(args.num_prompts, args.seed)
        prompts = [prompt_ids(real.tokenizer, m) for _, m in rows]
    else:  # text prompts, tokenized as the job does (the tokenizer's own special tokens)
        texts = hh_rows(args.num_prompts // 2, args.max_prompt_tokens, real.tokenizer, args.seed)
        prompts = [list(real.tokenizer(r["text"])["input_ids"]) for r in texts]
    outs = real.generate(prompts, SamplingParams(max_tokens=args.max_tokens))
    lengths = [len(o.token_ids) for o in outs]
    real_steps = real.stats.num_steps
    # The tiny model's KV is far smaller per token: give it the real engine's block count, so
    # a schedule bound by KV room (long prompts: HH) preempts where the real one does.
    num_kv_blocks = real.kv.num_blocks
    del real
    tiny = save_tiny_model(Path(tempfile.mkdtemp(prefix="order-steps-")) / "model")
    steps = {
        name: count_steps(str(tiny), prompts, lengths, batches, num_kv_blocks)
        for name, batches in orders(prompts, lengths, args.shard_size, args.max_tokens).items()
    }
    result = json.dumps(
        {
            "dataset": args.dataset,
            "prompts": len(prompts),
            "max_tokens": args.max_tokens,
            "generated_tokens": sum(lengths),
            "real_engine_steps_input_order": real_steps,
            "num_kv_blocks": num_kv_blocks,
            "steps": steps,
        },
        indent=2,
    )
    if args.json:
        Path(args.json).write_text(result + "\n")
    print(result)


if __name__ == "__main__":
    main()
