"""The dry run's engine-time estimate (pipeline/job/dry_run.py): a short calibration of the job's
engine in this process, and the arithmetic that turns it and the plan into seconds.

Calibration, with the job's engine built here (no Ray, no actor):

    warm-up step -> prefill of a few of the input's rows, spread over it (prompt tokens/s:
       the median of its full steps)
    -> those rows generated to completion with their own sampling (stops, EOS, max_tokens):
       their output lengths, and the time of each decode step at the sizes their batch
       shrinks through -> a few decode steps at the job's batch size (the sampled prompts
       again, cycled to that many: their cached blocks make the prefill next to nothing)
    -> a decode step's cost as a line in its batch size: overhead + per-sequence x batch

The estimate, per engine (its share of the rows and of the prompt tokens to compute):

    prefill  = tokens to compute / prompt tokens per s
    decode   = steps x overhead + decode tokens x per-sequence cost
    decode tokens = sequences x (mean output - 1)     (a sequence's first token ends its prefill)
    steps    = max(longest output - 1, ceil(decode tokens / batch cap) + longest - mean)

with batch cap = min(max_num_seqs, max_num_batched_tokens): the engine decodes every running
sequence each step, decodes first, so a step holds at most that many. Few rows run as one
batch that shrinks as rows finish, until the longest ends; many rows keep the batch full until
the last ones drain. Prefill steps are counted apart from decode steps (the engine mixes them:
an upper bound of the steps' overhead).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

SAMPLE_ROWS = 8  # rows generated to completion for the output lengths
SAMPLE_PROMPT_TOKENS = 4096  # ... as long as their prompts stay within this (at least one row)
CALIBRATION_DECODE_STEPS = 4  # decode steps timed at the job's batch size
# The job's own start before an engine is loaded (its Ray Data stages read, tokenize and plan,
# an engine actor starts), as its summary's clock counts it (not Ray's start): 6.1 s for the
# bundled snippet sample on the 2-core box (2026-11-26, docs/benchmarks-job.md). A measured
# figure, not a calibration: a dry run starts no Ray to time it.
JOB_START_S = 6.0


@dataclass(frozen=True)
class Calibration:
    """The engine's speed on this machine and the sampled rows' output lengths."""

    prefill_tokens_per_s: float
    step_overhead_s: float  # a decode step's cost apart from its sequences
    step_per_sequence_s: float  # ... and per sequence it decodes
    sampled_rows: int
    mean_output_tokens: float  # per sequence of the sampled rows, stops and EOS included
    max_output_tokens: int
    seconds: float  # the calibration's own time (model load included)
    load_s: float = 0.0  # the engine's build (model load) here

    def job_start_s(self) -> float:
        """The job's time before its engines run: `JOB_START_S` + this model load."""
        return JOB_START_S + self.load_s

    def decode_step_s(self, batch: int) -> float:
        """One decode step of `batch` sequences."""
        return self.step_overhead_s + self.step_per_sequence_s * batch


@dataclass(frozen=True)
class Workload:
    """What the engines get: from the plan and the engine's limits."""

    sequences: int  # rows reaching the engine x samples per row
    tokens_to_compute: int  # prompt tokens (shared prefixes once)
    num_engines: int  # side by side, over all the engine actors
    max_num_seqs: int
    max_num_batched_tokens: int

    @property
    def batch_cap(self) -> int:
        """Sequences one step decodes at most."""
        return min(self.max_num_seqs, self.max_num_batched_tokens)

    def batch(self) -> int:
        """The batch an engine starts decoding with."""
        return min(math.ceil(self.sequences / self.num_engines), self.batch_cap)


@dataclass(frozen=True)
class Estimate:
    """The estimated time of one engine (they run side by side), in its parts."""

    prefill_s: float
    decode_s: float
    decode_steps: int
    decode_tokens: float

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s


def estimate(work: Workload, cal: Calibration) -> Estimate:
    """The arithmetic of the module docstring."""
    sequences = math.ceil(work.sequences / work.num_engines)
    prefill = work.tokens_to_compute / work.num_engines / cal.prefill_tokens_per_s
    mean, longest = cal.mean_output_tokens, cal.max_output_tokens
    decode_tokens = sequences * max(mean - 1, 0.0)
    steps = max(longest - 1, math.ceil(decode_tokens / work.batch_cap + longest - mean))
    steps = max(steps, 0)
    decode = steps * cal.step_overhead_s + decode_tokens * cal.step_per_sequence_s
    return Estimate(prefill, decode, steps, decode_tokens)


def fit_step_cost(steps: list[tuple[int, float]]) -> tuple[float, float]:
    """(overhead, per sequence) of a line through the median step time at each batch size
    (least squares); with one batch size, all of it per sequence. Neither below zero."""
    by_batch: dict[int, list[float]] = defaultdict(list)
    for batch, seconds in steps:
        by_batch[batch].append(seconds)
    points = [(b, statistics.median(t)) for b, t in sorted(by_batch.items())]
    if not points:
        return 0.0, 0.0
    if len(points) == 1:
        b, t = points[0]
        return 0.0, t / b
    xs, ys = [float(b) for b, _ in points], [t for _, t in points]
    slope, intercept = statistics.linear_regression(xs, ys)
    if slope < 0:  # noise at tiny costs: a flat step
        return statistics.fmean(ys), 0.0
    if intercept < 0:
        return 0.0, statistics.fmean(t / b for b, t in points)
    return intercept, slope


def sample_rows(num: int, lens: list[int]) -> list[int]:
    """Up to `SAMPLE_ROWS` row indexes spread evenly over `num` rows, while their prompt
    lengths (`lens`) stay within `SAMPLE_PROMPT_TOKENS` (the first always)."""
    chosen: list[int] = []
    total, count = 0, min(num, SAMPLE_ROWS)
    for i in (j * num // count for j in range(count)):
        if chosen and total + lens[i] > SAMPLE_PROMPT_TOKENS:
            break
        chosen.append(i)
        total += lens[i]
    return chosen


def calibrate(engine_config, prompts: list[list[int]], params: list, batch: int) -> Calibration:  # noqa: ANN001 (EngineConfig)
    """Time the engine on `prompts` (the sampled rows, with their SamplingParams `params`):
    the module docstring's calibration, `batch` the job's decode batch."""
    from actors import LLMEngine
    from actors.config import SamplingParams

    started = time.perf_counter()
    engine = LLMEngine(engine_config)
    load_s = time.perf_counter() - started
    # A first step pays one-time costs (torch's first forward, the attention kernel's load):
    # 4x the prefill's time in a fresh process here. Paid before anything is timed.
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=2))

    prefill: list[tuple[int, float]] = []
    _run(engine, prompts, [SamplingParams(max_tokens=1)] * len(prompts), None, [], prefill)

    # Their prompts' full blocks are cached now: this is (nearly) all decode.
    steps: list[tuple[int, float]] = []
    lengths = _run(engine, prompts, params, None, steps)
    if batch > len(lengths):
        # The job's batch of the sampled prompts over again: their full blocks are cached, so
        # only each copy's last partial block is computed; no prefix group, so each sequence
        # reads its own context as a row of the job does (a group's shared read would make
        # the step look cheaper than the job's).
        copies = [prompts[i % len(prompts)] for i in range(batch)]
        fixed = SamplingParams(max_tokens=CALIBRATION_DECODE_STEPS + 1, ignore_eos=True)
        _run(engine, copies, [fixed] * batch, None, steps)
    overhead, per_sequence = fit_step_cost(steps)
    return Calibration(
        prefill_tokens_per_s=prefill_rate(prefill, engine_config.max_num_batched_tokens),
        step_overhead_s=overhead,
        step_per_sequence_s=per_sequence,
        sampled_rows=len(prompts),
        mean_output_tokens=statistics.fmean(lengths) if lengths else 0.0,
        max_output_tokens=max(lengths, default=0),
        seconds=time.perf_counter() - started,
        load_s=load_s,
    )


def prefill_rate(steps: list[tuple[int, float]], budget: int) -> float:
    """Prompt tokens per second: the median of the steps that computed at least half the
    step's `budget` (one slow step, a stray one-time cost or a neighbour's burst, does not
    set it), else of all the steps' tokens over their time."""
    full = [tokens / seconds for tokens, seconds in steps if tokens * 2 >= budget and seconds]
    if full:
        return statistics.median(full)
    return sum(t for t, _ in steps) / max(sum(s for _, s in steps), 1e-9)


def _run(engine, prompts, params, groups, steps, other=None) -> list[int]:  # noqa: ANN001
    """Run `prompts` to completion step by step; append (batch, seconds) of each step that only
    decoded to `steps`, (tokens, seconds) of the others to `other`; the finished sequences'
    output lengths."""
    engine.add_prompts(prompts, params, groups)
    lengths: list[int] = []
    while engine.has_unfinished():
        before, t0 = engine.stats.num_scheduled_tokens, time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - t0
        tokens = engine.stats.num_scheduled_tokens - before
        if tokens and tokens == len(outputs):  # one token for each sequence: decodes only
            steps.append((tokens, elapsed))
        elif tokens and other is not None:
            other.append((tokens, elapsed))
        lengths.extend(len(out.token_ids) for out in outputs if out.finished)
    return lengths
