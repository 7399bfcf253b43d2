"""Several samples per prompt (issue 29): what `n` costs in prompt tokens computed.

`count` Alpaca prompts (chat-templated, token ids) on the embedded SmolLM2-135M, `max_tokens`
new tokens each (EOS ignored, so every method decodes the same count), three ways, each on
its own engine:
- `once`: each prompt once, n=1 (the baseline: one prefill per prompt);
- `n`: `SamplingParams(n=N)` (the prompt prefilled once, its KV shared by the N samples);
- `copies`: each prompt N times with n=1 and prefix caching on (full blocks shared by hash
  once the first copy has computed them, which it may not have yet when the others start);
- `copies_no_cache`: the same with prefix caching off (N whole prefills).

Per method: the tokens the steps computed (`EngineStats.num_scheduled_tokens`), the prompt
tokens among them (total minus the decodes: N x (max_tokens - 1) per prompt), the prompt
tokens the outputs count as cached, and whether greedy samples are identical across methods
(`once`: its one output per prompt against each of the others' N). Prefix caching is on except
in `copies_no_cache`: the chat template's system prompt is shared by every prompt, so a
prompt's first full blocks may come from the cache in any method; compare `n` with `once`,
which differ by exactly the N - 1 last prompt tokens the extra samples compute.
Counts only, no timing: nothing here needs a quiet machine.

    python benchmarks/bench_samples.py --count 16 --n 4 --output docs/samples.json
"""

from __future__ import annotations

import argparse
from typing import Any

import _bench_common as common
from _bench_common import DATA_DIR

from actors import EngineConfig, LLMEngine, SamplingParams, loader


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--count", type=int, default=16, help="prompts")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="which prompts")
    p.add_argument("--output", help="write the JSON result here")
    p.add_argument("--json", action="store_true", help="print the JSON result")
    return p.parse_args(argv)


def run(method: str, prompts: list[list[int]], n: int, max_tokens: int) -> dict[str, Any]:
    """One method on a fresh engine: token counts and the generated tokens."""
    engine = LLMEngine(EngineConfig(enable_prefix_caching=method != "copies_no_cache"))
    if method == "once":
        n = 1
    if method in ("n", "once"):
        outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True))
    else:
        copies = [p for p in prompts for _ in range(n)]
        outs = engine.generate(copies, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    computed = engine.stats.num_scheduled_tokens
    decodes = len(prompts) * n * (max_tokens - 1)
    return {
        "scheduled_tokens": computed,
        "prompt_tokens_computed": computed - decodes,
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs),
        "tokens": [list(o.token_ids) for o in outs],
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    common.setup_torch(args.threads)
    tokenizer = loader.load_tokenizer("smollm2")
    prompts = common.sample(common.alpaca_prompts(tokenizer, DATA_DIR), args.count, args.seed)
    results = {
        m: run(m, prompts, args.n, args.max_tokens)
        for m in ("once", "n", "copies", "copies_no_cache")
    }
    tokens = {m: r.pop("tokens") for m, r in results.items()}
    tokens["once"] = [t for t in tokens["once"] for _ in range(args.n)]
    result = {
        "prompts": args.count,
        "n": args.n,
        "max_tokens": args.max_tokens,
        "prompt_tokens": sum(len(p) for p in prompts),
        "methods": results,
        "same_tokens": len({str(t) for t in tokens.values()}) == 1,
        "machine": common.machine(),
    }
    common.emit(result, args.json, args.output)
    for method, r in results.items():
        common.log(
            f"{method}: {r['prompt_tokens_computed']} prompt tokens computed, "
            f"{r['cached_prompt_tokens']} counted cached"
        )


if __name__ == "__main__":
    main()
