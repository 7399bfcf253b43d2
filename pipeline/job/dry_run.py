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

The estimate (pipeline/job/estimate.py): a few of the input's rows generated to completion by the
job's engine in this process give the output length rows really reach (stops, EOS) and the
engine's speed here (prompt tokens per second, a decode step's cost by its batch size); the
engine time is then the plan's prompt tokens to compute at that speed plus the decode steps the
engine's batch limits (max_num_seqs, the step's token budget) make of those lengths.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from dataclasses import dataclass, replace

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import JobConfig
from pipeline.io import storage
from pipeline.job.engine_count import count_for_job
from pipeline.job.estimate import Calibration, Workload, calibrate, estimate, sample_rows
from pipeline.stages import stage


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
    samples_per_row: int  # the job's n
    num_engines: int  # over all the engine actors (ComputeConfig.num_engines)
    max_num_seqs: int
    max_num_batched_tokens: int
    calibration: Calibration | None
    picture: str | None

    @property
    def tokens_to_compute(self) -> int:
        """Prompt tokens the engines compute (shared prefixes once)."""
        return self.prompt_tokens - self.saved_tokens

    def workload(self) -> Workload:
        """What the engines get."""
        return Workload(
            sequences=(self.rows - self.error_rows) * self.samples_per_row,
            tokens_to_compute=self.tokens_to_compute,
            num_engines=self.num_engines,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
        )

    def engine_seconds(self) -> float | None:
        """The estimated engine time (pipeline/job/estimate.py), or None uncalibrated."""
        if self.calibration is None or self.rows == self.error_rows:
            return None
        return estimate(self.workload(), self.calibration).seconds

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
            work = self.workload()
            parts = estimate(work, cal)
            lines.append(
                f"engine time: about {_duration(seconds)} on {self.num_engines} engine(s) "
                f"(prefill {parts.prefill_s:.0f} s, decode {parts.decode_s:.0f} s in "
                f"{parts.decode_steps} steps of up to {work.batch()} sequences). An estimate "
                f"from {cal.seconds:.0f} s of calibration here on {cal.sampled_rows} sampled "
                f"rows: they generated {cal.mean_output_tokens:.1f} tokens on average (at most "
                f"{cal.max_output_tokens}, --max-tokens {self.max_tokens}); prefill "
                f"{cal.prefill_tokens_per_s:.0f} prompt tokens/s; a decode step "
                f"{cal.step_overhead_s * 1000:.0f} ms + {cal.step_per_sequence_s * 1000:.1f} "
                f"ms per sequence ({cal.decode_step_s(work.batch()) * 1000:.0f} ms at "
                f"{work.batch()}). Assumes the other rows' outputs as long as the sample's, "
                "each actor as fast as this process (actors sharing one machine's cores are "
                "slower)"
            )
            lines.append(
                f"the job: about {_duration(seconds + cal.job_start_s())} with its start "
                f"(about {cal.job_start_s():.0f} s: its stages and engine actors starting, "
                f"measured once on a 2-core box, and the model load, {cal.load_s:.1f} s here), "
                "as its summary counts it; Ray's own start comes before"
            )
        if self.picture:
            lines.append(f"the plan's picture: {self.picture}")
        return "\n".join(lines)


def dry_run(config: JobConfig, prepared, calibrate: bool = True) -> DryRun:  # noqa: ANN001 (PreparedJob)
    """Read, tokenize and plan the job in this process; calibrate the engine when asked."""
    from pipeline.job.run import job_processor
    from pipeline.stages.plan import plan_partition
    from pipeline.stages.prompts import RowIdStage
    from pipeline.stages.tokenize import TokenizeStage

    table = read_table(prepared.source, config.input.hf_split)
    done = done_ids(config.output)
    ids = RowIdStage(prepared.id_column, done)(table)
    # counted as the job counts them, on this machine (a dry run starts no Ray)
    config = count_for_job(config, prepared.resolved_model, ids.num_rows, {})[0]
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
    # The job's shards as it cuts them; here every row is in one partition.
    _, spread = job_processor(config, prepared).shard_dispatch()
    if spread is not None:
        spread = replace(spread, partitions=1)
    shards, stats = plan_partition(tokens, config.plan, config.sampling, (), spread)
    ok = tokens.filter(pc.is_null(tokens.column(stage.ERROR)))
    prompts = ok.column(stage.PROMPT_TOKEN_IDS).to_pylist()
    calibration = None
    if calibrate and prompts:
        calibration = calibrate_sample(config, ok, prompts)
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
        samples_per_row=config.sampling.n,
        num_engines=config.compute.num_engines,
        max_num_seqs=config.engine.max_num_seqs,
        max_num_batched_tokens=config.engine.max_num_batched_tokens,
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
    run itself deletes cut files: pipeline/io/resume.py)."""
    import json

    import pyarrow.parquet as pq

    from pipeline.io.output import DATA_PREFIX, STATE_FILE
    from pipeline.io.resume import data_files

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


def calibrate_sample(config: JobConfig, ok: pa.Table, prompts: list[list[int]]) -> Calibration:
    """Calibrate the job's engine (pipeline/job/estimate.py) on a few of the rows that reach it,
    each with its own sampling (the job's, with the row's overrides)."""
    import json

    from pipeline.stages.prompts import merge_sampling

    chosen = sample_rows(len(prompts), [len(p) for p in prompts])
    overrides = ok.column(stage.SAMPLING).to_pylist()
    params = [merge_sampling(config.sampling, json.loads(overrides[i] or "{}")) for i in chosen]
    work = Workload(
        sequences=len(prompts) * config.sampling.n,
        tokens_to_compute=0,
        num_engines=config.compute.num_engines,
        max_num_seqs=config.engine.max_num_seqs,
        max_num_batched_tokens=config.engine.max_num_batched_tokens,
    )
    return calibrate(config.engine, [prompts[i] for i in chosen], params, work.batch())


def draw_plan(ok: pa.Table, shards: pa.Table, stats) -> str | None:  # noqa: ANN001 (PlanStats)
    """The report's picture (pipeline/io/report.py `plot`) of the plan, in a temporary file."""
    from pipeline.io.report import plot

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
