"""`raypack generate ... --dry-run`: what the job would do and about how long its engines would
take, without starting Ray or an engine actor.

    read the input (in this process) -> ids, rows already in --output dropped -> tokenize
    -> plan (one partition) -> a few seconds of the real engine, in this process
    -> the plan's figures, the estimate and its assumptions, the report's picture of the plan

The stages are the job's own (`RowIdStage`, `TokenizeStage`, `plan_partition`), called on the
whole input at once instead of through Ray Data, so the rows, groups, savings and shards are
the job's (one shuffle partition: with several, rows that share a prefix key still meet in
one, so the first-level groups are the same). Nothing is written: not the output folder's
lock or lineage, not a data file; the picture goes to a temporary file.

The estimate: a short prefill (about `CALIBRATION_PROMPT_TOKENS` of the input's own prompts)
gives the engine's prompt tokens per second; a batch of the job's size decoding
`CALIBRATION_DECODE_STEPS` steps gives the time of one decode step. The engine time is then
(prompt tokens to compute) / that rate + (decode steps) x that time, with decode steps =
ceil(rows per actor / sequences at once) x --max-tokens: an upper bound on the decode, since
a stop string or EOS ends a row sooner.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from pipeline import stage, storage
from pipeline.config import JobConfig

CALIBRATION_PROMPT_TOKENS = 512  # prompt tokens of the prefill calibration (about one step)
CALIBRATION_DECODE_STEPS = 3  # decode steps timed at the job's batch size


@dataclass(frozen=True)
class Calibration:
    """The engine's speed on this machine, measured in this process."""

    prefill_tokens_per_s: float
    decode_step_s: float  # one decode step of `batch` sequences
    batch: int
    seconds: float  # the calibration's own time (model load included)


@dataclass(frozen=True)
class DryRun:
    """What the job would do."""

    input_rows: int
    done_rows: int
    rows: int  # to generate (error rows included: they never reach the engine)
    error_rows: int
    prompt_tokens: int
    saved_tokens: int  # computed once per group, not per row
    optimal_saved_tokens: int
    shards: int
    shared_groups: int
    max_share_degree: int
    max_tokens: int
    num_actors: int
    calibration: Calibration | None
    picture: str | None

    @property
    def tokens_to_compute(self) -> int:
        """Prompt tokens the engines compute (shared prefixes once)."""
        return self.prompt_tokens - self.saved_tokens

    def engine_seconds(self) -> float | None:
        """The estimated engine time (see the module docstring), or None uncalibrated."""
        cal = self.calibration
        runnable = self.rows - self.error_rows
        if cal is None or runnable == 0:
            return None
        per_actor = math.ceil(runnable / self.num_actors)
        waves = math.ceil(per_actor / cal.batch)
        prefill = self.tokens_to_compute / self.num_actors / cal.prefill_tokens_per_s
        return prefill + waves * self.max_tokens * cal.decode_step_s

    def text(self, output: str) -> str:
        """The printout."""
        ratio = self.saved_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        optimum = self.optimal_saved_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        of_optimum = f", {ratio / optimum:.0%} of it" if optimum else ""
        lines = [
            "dry run: nothing generated or written, no engine actor started",
            f"rows: {self.input_rows} in the input, {self.done_rows} already done in {output}, "
            f"{self.rows} to run ({self.error_rows} with an error before the engine)",
            f"prefix groups: {self.shared_groups} shared by two rows or more (the largest "
            f"{self.max_share_degree} rows)",
            f"prefix saving: {ratio:.1%} of the prompt tokens (optimum {optimum:.1%}{of_optimum})",
            f"prompt tokens: {self.prompt_tokens} in all, {self.tokens_to_compute} to compute",
            f"shards: {self.shards}",
        ]
        seconds = self.engine_seconds()
        cal = self.calibration
        if seconds is not None and cal is not None:
            lines.append(
                f"engine time: about {_duration(seconds)} on {self.num_actors} engine "
                f"actor(s), from {cal.seconds:.0f} s of calibration here: prefill "
                f"{cal.prefill_tokens_per_s:.0f} prompt tokens/s, a decode step of {cal.batch} "
                f"sequences {cal.decode_step_s * 1000:.0f} ms. Assumes every row generates "
                f"--max-tokens {self.max_tokens} (a stop or EOS ends rows sooner), each actor "
                "as fast as this process (actors sharing one machine's cores are slower), "
                "and leaves out the job's start (Ray, actors, model load)"
            )
        if self.picture:
            lines.append(f"the plan's picture: {self.picture}")
        return "\n".join(lines)


def dry_run(config: JobConfig, prepared, calibrate: bool = True) -> DryRun:  # noqa: ANN001 (PreparedJob)
    """Read, tokenize and plan the job in this process; calibrate the engine when asked."""
    from pipeline.plan import plan_partition
    from pipeline.prompts import RowIdStage
    from pipeline.tokenize import TokenizeStage

    table = read_table(prepared.source, config.input.hf_split)
    done = done_ids(config.output)
    ids = RowIdStage(prepared.id_column, done)(table)
    tokenize = TokenizeStage(
        config.prompt,
        model=prepared.resolved_model,
        max_model_len=prepared.max_model_len,
        sampling=config.sampling,
        override_columns=config.prompt.override_columns,
        key_block_size=config.plan.key_block_size,
        trust_remote_code=config.engine.trust_remote_code,
    )
    tokens = tokenize(ids)
    shards, stats = plan_partition(tokens, config.plan, config.sampling, ())
    ok = tokens.filter(pc.is_null(tokens.column(stage.ERROR)))
    prompts = ok.column(stage.PROMPT_TOKEN_IDS).to_pylist()
    calibration = None
    if calibrate and prompts:
        batch = min(math.ceil(len(prompts) / config.compute.num_actors), config.engine.max_num_seqs)
        calibration = calibrate_engine(config, prompts, batch)
    return DryRun(
        input_rows=table.num_rows,
        done_rows=table.num_rows - ids.num_rows,
        rows=stats.rows,
        error_rows=stats.error_rows,
        prompt_tokens=stats.prompt_tokens,
        saved_tokens=stats.planned_saved_tokens,
        optimal_saved_tokens=stats.optimal_saved_tokens,
        shards=stats.num_shards,
        shared_groups=sum(n for d, n in stats.share_degrees.items() if d > 1),
        max_share_degree=max(stats.share_degrees, default=0),
        max_tokens=config.sampling.max_tokens,
        num_actors=config.compute.num_actors,
        calibration=calibration,
        picture=draw_plan(ok, shards, stats),
    )


def read_table(source, hf_split: str | None) -> pa.Table:  # noqa: ANN001 (read.InputSource)
    """The whole input as one Arrow table, read here (no Ray)."""
    import pyarrow.csv as pacsv
    import pyarrow.json as pajson
    import pyarrow.parquet as pq

    if source.format == "hf":
        import datasets

        data = datasets.load_from_disk(source.paths[0])
        if isinstance(data, datasets.DatasetDict):
            data = data[hf_split or next(iter(data))]
        return data.data.table
    tables = []
    for path in source.paths:
        with storage.open_input(path) as handle:
            if source.format == "parquet":
                tables.append(pq.read_table(handle))
            elif source.format == "jsonl":
                tables.append(pajson.read_json(handle))
            else:
                options = pacsv.ParseOptions(newlines_in_values=True)
                tables.append(pacsv.read_csv(handle, parse_options=options))
    return pa.concat_tables(tables, promote_options="permissive")


def done_ids(output: str) -> set[str]:
    """The ids already in this job's files of `output`, read without changing anything (the
    run itself deletes cut files: pipeline/resume.py)."""
    import json

    import pyarrow.parquet as pq

    from pipeline.output import DATA_PREFIX, STATE_FILE
    from pipeline.resume import data_files

    state = storage.join(output, STATE_FILE)
    if storage.kind(state) is None:
        return set()
    token = json.loads(storage.read_bytes(state))["job"]
    ids: set[str] = set()
    for path in data_files(output, f"{DATA_PREFIX}{token}"):
        try:
            with storage.open_input(path) as handle:
                ids.update(pq.read_table(handle, columns=[stage.ID]).column(0).to_pylist())
        except Exception:  # noqa: BLE001, S112 (a cut file: its rows are not done)
            continue
    return ids


def calibrate_engine(config: JobConfig, prompts: list[list[int]], batch: int) -> Calibration:
    """Time a short prefill of the input's first prompts and `CALIBRATION_DECODE_STEPS` decode
    steps of `batch` sequences (one of those prompts, `batch` times in a prefix group, so its
    prefill is not computed again), with the job's engine in this process."""
    from actors import LLMEngine
    from actors.config import SamplingParams
    from packing.prefix import PrefixGroup

    started = time.perf_counter()
    engine = LLMEngine(config.engine)
    # A first step pays one-time costs (torch's first forward, the attention kernel's load):
    # 4x the prefill's time in a fresh process here. Paid before anything is timed.
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=2))
    chosen: list[list[int]] = []
    for prompt in prompts:
        if chosen and sum(map(len, chosen)) + len(prompt) > CALIBRATION_PROMPT_TOKENS:
            break
        chosen.append(prompt)
    before = engine.stats.num_scheduled_tokens
    t0 = time.perf_counter()
    engine.generate(chosen, SamplingParams(max_tokens=1))
    prefill_s = time.perf_counter() - t0
    computed = engine.stats.num_scheduled_tokens - before

    # One of the prompts just computed: its blocks are in the prefix cache, so the group's
    # prefix costs next to nothing and only the decode steps are timed.
    prompt = sorted(chosen, key=len)[len(chosen) // 2]
    params = SamplingParams(max_tokens=CALIBRATION_DECODE_STEPS + 1, ignore_eos=True)
    group = PrefixGroup(len(prompt) - 1, tuple(range(batch)))
    engine.add_prompts([prompt] * batch, params, [group])
    decode_steps: list[float] = []
    while engine.has_unfinished():
        before, t0 = engine.stats.num_scheduled_tokens, time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t0
        if engine.stats.num_scheduled_tokens - before == batch:  # every sequence decodes
            decode_steps.append(elapsed)
    step_s = statistics.median(decode_steps) if decode_steps else elapsed
    return Calibration(
        prefill_tokens_per_s=computed / max(prefill_s, 1e-9),
        decode_step_s=step_s,
        batch=batch,
        seconds=time.perf_counter() - started,
    )


def draw_plan(ok: pa.Table, shards: pa.Table, stats) -> str | None:  # noqa: ANN001 (PlanStats)
    """The report's picture (pipeline/report.py `plot`) of the plan, in a temporary file."""
    from pipeline.report import plot

    lens = ok.column(stage.NUM_PROMPT_TOKENS).to_pylist()
    if not lens:
        return None
    padded = 0
    for row in shards.column(stage.NUM_PROMPT_TOKENS).to_pylist():
        row = [n for n in row if n]
        padded += max(row, default=0) * len(row)
    prompt = sum(lens)
    distributions = {
        "prompt_lens": Counter(lens),
        "share_degrees": Counter(stats.share_degrees),
        "tokens": Counter({0: padded, 1: prompt, 2: prompt - stats.planned_saved_tokens}),
    }
    path = tempfile.NamedTemporaryFile(prefix="raypack-plan-", suffix=".png", delete=False).name
    plot(distributions, path)
    return path


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
