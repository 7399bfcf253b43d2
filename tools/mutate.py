"""A small mutation check: plant one deliberate bug at a time in a copy of the repository and
see whether the chosen tests fail ("killed") or still pass ("survived").

    python tools/mutate.py            # all mutations; prints a table and the kill rate
    python tools/mutate.py -k sampler -k kv  # only mutations whose name contains either

Only Ray-free tests run (engine, sampler, planner, Serve request mapping), one thread each, so
it is safe on a shared machine. A mutation whose original text is no longer in the file (the
code moved on) is reported as "stale", not counted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ENGINE = ["tests/actors/test_exactness.py"]  # whole files: -k would filter every file
SAMPLER = [
    "tests/actors/test_sampling.py",
    "tests/actors/test_sampling_distribution.py",
    "tests/actors/test_logprobs_hf.py",
]
MAPPING = ["tests/serve/test_request_mapping.py", "tests/serve/test_limits_and_keys.py"]
RESUME = ["tests/pipeline/test_prompts.py", "tests/pipeline/test_read_resume.py"]
PENALTIES = ["tests/actors/test_penalties.py"]


@dataclass(frozen=True)
class Mutation:
    """Replace `old` (exactly once in `path`) by `new`; `tests` should then fail."""

    name: str
    path: str
    old: str
    new: str
    tests: list[str]


MUTATIONS = [
    # sampler
    Mutation("sampler: temperature multiplies", "actors/sampler.py",
             "logits = logits / temperature[:, None]", "logits = logits * temperature[:, None]", SAMPLER),
    Mutation("sampler: top-k keeps one more", "actors/sampler.py",
             "ranks[None, :] >= top_k[:, None]", "ranks[None, :] > top_k[:, None]", SAMPLER),
    Mutation("sampler: top-p drops the best token", "actors/sampler.py",
             "outside = (mass_before >= top_p[:, None])", "outside = (mass_before + probs >= top_p[:, None])", SAMPLER),
    Mutation("sampler: logprobs from half the logits", "actors/sampler.py",
             "torch.log_softmax(logits[wanted], dim=-1)", "torch.log_softmax(logits[wanted] / 2, dim=-1)", SAMPLER),
    Mutation("sampler: seeded requests use the shared generator", "actors/sampler.py",
             "noise[i].exponential_(generator=requests[i].generator)", "noise[i].exponential_(generator=self.generator)", SAMPLER),
    Mutation("sampler: min_tokens off by one", "actors/sampler.py",
             "if req.num_output_tokens >= params.min_tokens:", "if req.num_output_tokens + 1 >= params.min_tokens:", SAMPLER),
    Mutation("sampler: ignore_eos ignored when banning", "actors/sampler.py",
             "            if not params.ignore_eos:\n                banned.extend", "            if True:\n                banned.extend", SAMPLER),
    # attention
    Mutation("attention: cached-prefix mask off by one", "actors/attention/sdpa.py",
             "np.arange(cached + new)[None, :] <= rows[:, None]",
             "np.arange(cached + new)[None, :] < rows[:, None] + 2", ENGINE),
    Mutation("attention: decode sees one key less", "actors/attention/sdpa.py",
             "key_mask = keys[None, :] < seq_lens[:, None]", "key_mask = keys[None, :] < seq_lens[:, None] - 1", ENGINE),
    Mutation("attention: fresh prefill not causal", "actors/attention/sdpa.py",
             "is_causal=seg.key_slots is None and seg.q_end - seg.q_start > 1,", "is_causal=False,", ENGINE),
    # KV copy and prefix sharing
    Mutation("kv: partial prefix block not copied", "actors/model_runner.py",
             "        self.copy_blocks(sched.block_copies)", "        self.copy_blocks([])", ENGINE),
    Mutation("kv: group shares one token too many", "actors/scheduler.py",
             "num_shared = min(group.prefix.num_tokens, req.num_tokens - 1)",
             "num_shared = min(group.prefix.num_tokens + 1, req.num_tokens - 1)", ENGINE),
    Mutation("kv: copy only the V cache", "actors/model_runner.py",
             "            k_cache[dst] = k_cache[src]\n", "", ENGINE),
    # scheduler admission
    Mutation("scheduler: admission ignores the token budget", "actors/scheduler.py",
             "num_new = min(req.num_tokens - num_shared, chunk, budget)",
             "num_new = min(req.num_tokens - num_shared, chunk)", ["tests/actors/test_scheduler.py", *ENGINE]),
    Mutation("scheduler: computed tokens start at 0 for shared prefixes", "actors/scheduler.py",
             "req.num_computed_tokens = num_shared", "req.num_computed_tokens = 0", ["tests/actors/test_scheduler.py", *ENGINE]),
    # resume
    Mutation("resume: done rows kept", "pipeline/stages/prompts.py",
             "keep = [i not in self.done_ids for i in ids]", "keep = [True for i in ids]", RESUME),
    Mutation("resume: cut files kept", "pipeline/io/resume.py",
             "            storage.delete(path)\n            removed.append(path)\n            continue\n",
             "            removed.append(path)\n            continue\n", RESUME),
    Mutation("resume: files left open kept", "pipeline/io/resume.py",
             "            storage.delete(path)\n            removed.append(path)\n    return removed\n",
             "            removed.append(path)\n    return removed\n", RESUME),
    # penalties
    Mutation("penalties: presence paid per use", "actors/penalties.py",
             "pres[:, None] * (counts > 0).to(sub.dtype)", "pres[:, None] * counts", PENALTIES),
    Mutation("penalties: repetition divides every logit", "actors/penalties.py",
             "torch.where(sub > 0, sub / penalty, sub * penalty)", "sub / penalty", PENALTIES),
    Mutation("penalties: repetition ignores the prompt", "actors/penalties.py",
             "seen = (counts > 0) | (_token_counts(prompts, vocab, sub.dtype) > 0)",
             "seen = counts > 0", PENALTIES),
    # Serve request mapping
    Mutation("serve: temperature default 0", "pipeline/serve/service.py",
             "temperature=1.0 if request.temperature is None", "temperature=0.0 if request.temperature is None", MAPPING),
    Mutation("serve: top_k dropped", "pipeline/serve/service.py",
             "top_k=request.top_k or 0,", "top_k=0,", MAPPING),
    Mutation("serve: seed dropped", "pipeline/serve/service.py", "seed=request.seed,", "seed=None,", MAPPING),
    Mutation("serve: ignore_eos dropped", "pipeline/serve/service.py",
             "ignore_eos=request.ignore_eos,", "ignore_eos=False,", MAPPING),
    Mutation("serve: stop strings dropped", "pipeline/serve/service.py",
             "stop=request.stop_strings(),", "stop=(),", MAPPING),
    Mutation("serve: prompt limit off by one", "pipeline/serve/service.py",
             "if len(ids) > self.max_prompt_tokens:", "if len(ids) > self.max_prompt_tokens + 1:", MAPPING),
]  # fmt: skip


def run_tests(copy: Path, tests: list[str], timeout_s: float) -> str:
    """'killed' when the tests fail (or time out), 'survived' when they pass."""
    env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        done = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "killed (timeout)"
    if done.returncode == 5:
        return "no tests"
    return "survived" if done.returncode == 0 else "killed"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "-k",
        action="append",
        default=[],
        help="only mutations whose name contains this (repeatable)",
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds per test run")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.k or any(k in m.name for k in args.k)]
    with tempfile.TemporaryDirectory(prefix="rpx-mutate-") as tmp:
        copy = Path(tmp) / "repo"
        files = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
        for name in files:
            if (ROOT / name).is_file():
                (copy / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, copy / name)
        baseline = sorted({t for m in chosen for t in m.tests if t.startswith("tests/")})
        if run_tests(copy, baseline, args.timeout) != "survived":
            print("the unmutated tests fail: fix them first", file=sys.stderr)
            return 1
        results = []
        for m in chosen:
            target = copy / m.path
            original = target.read_text() if target.is_file() else ""
            if original.count(m.old) != 1:
                results.append((m, "stale"))
            else:
                target.write_text(original.replace(m.old, m.new))
                try:
                    results.append((m, run_tests(copy, m.tests, args.timeout)))
                finally:
                    target.write_text(original)
            print(f"{results[-1][1]:17} {m.name}", flush=True)
    counted = [r for _, r in results if r.startswith(("killed", "survived"))]
    killed = sum(r.startswith("killed") for r in counted)
    print(f"\n{killed}/{len(counted)} killed ({100 * killed / max(1, len(counted)):.0f}%), "
          f"{len(results) - len(counted)} stale or without tests")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
