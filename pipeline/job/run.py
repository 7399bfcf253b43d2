"""The offline job: check, build the Ray Data pipeline, run it, report.

    read -> ids (stable; drop ids already written) -> the processor's path (tokenize, shuffle
         by prefix key, plan, engine actors: `Processor.engine_rows`) -> Parquet (ShardSink)

The job's own parts are its ends and what only a job has: stable ids and resume, the
`StatsCollector` (one row per id across partitions, the plan's figures for the report), the
output folder's claim and lineage, tp x pp placement groups, the sized output files.

`prepare` runs on the driver without Ray and fails fast on a bad path, a missing column or an
unknown model. It resolves the input (`read.resolve_input`) and the model
(`actors.loader.resolve_model`) once each; every later step is handed those values. `run_job`
needs a connected Ray (see pipeline/commands/cli.py `connect_ray`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

from actors.allocator import preload_env
from actors.architectures import UnsupportedModelError
from actors.dtypes import choose_dtype, cpu_info
from actors.loader import ResolvedModel, resolve_model
from actors.parallel import placement
from pipeline.config import AUTO_ACTORS, OUTPUT_ID, JobConfig
from pipeline.io import lineage, storage
from pipeline.io.output import OutputFolder, check_output
from pipeline.io.read import (
    InputCheck,
    InputSource,
    check_columns,
    check_input,
    input_columns,
    read_dataset,
    resolve_input,
)
from pipeline.io.report import PlanStats, StatsCollector, Summary, summarize, write_report
from pipeline.io.resume import DoneIds, done_filter, scan_output
from pipeline.job import engine_placement
from pipeline.job.engine_count import count_for_job
from pipeline.job.engine_placement import EnginePlacements
from pipeline.job.phases import EngineMarks, JobClock
from pipeline.job.progress import ProgressBoard
from pipeline.processor.build import Processor, ProcessorConfig, model_facts
from pipeline.processor.datasets import without_reservations
from pipeline.stages.infer import InferStage
from pipeline.stages.prompts import SAMPLING_FIELDS, RowIdStage

logger = logging.getLogger(__name__)

BYTES_PER_PARTITION = 64 * 2**20  # input bytes per shuffle partition when not configured


@dataclass(frozen=True)
class PreparedJob:
    """What `prepare` found out, for the pipeline builder."""

    source: InputSource
    columns: tuple[str, ...]
    id_column: str | None
    override_columns: tuple[str, ...]
    max_model_len: int
    vocab_size: int
    num_partitions: int
    resolved_model: ResolvedModel  # the engine's model, resolved once for the whole job
    checked: InputCheck = InputCheck()


def prepare(config: JobConfig) -> PreparedJob:
    """Check the job against the input (every file read once, strictly: see
    `read.check_input`), the model's config and the output path (not a file); ValueError or
    FileNotFoundError before any work if something is wrong."""
    source = resolve_input(config.input, exclude=config.output)
    columns = input_columns(source, config.input.hf_split)
    prompt = config.prompt
    id_column = config.input.id_column
    if id_column is None and OUTPUT_ID in columns:
        id_column = OUTPUT_ID
        logger.info("using the input's %r column as the row id", OUTPUT_ID)
    elif id_column not in (None, OUTPUT_ID) and OUTPUT_ID in columns:
        logger.warning("the input's %r column is replaced by ids from %r", OUTPUT_ID, id_column)

    needed: dict[str, str] = {}
    if id_column:
        needed[id_column] = "the id column"
    for c in prompt.source_columns:
        needed[c] = "used by the template" if prompt.template else "the prompt source"
    for c in config.input.keep_columns:
        needed[c] = "asked to keep"
    for c in prompt.override_columns:
        needed[c] = "a sampling override column"
    if prompt.sampling_column:
        needed[prompt.sampling_column] = "the sampling parameters column"
    check_columns(columns, needed, config.input.path)

    overrides = prompt.override_columns
    if overrides:
        logger.info("per-row sampling overrides from columns %s", list(overrides))
    used = {id_column, *prompt.source_columns, *overrides}
    unused = [c for c in columns if c in SAMPLING_FIELDS and c not in used]
    if unused:  # the user may have meant them: say so (they change nothing unless named)
        logger.info(
            "columns %s are named like sampling parameters but do not override them "
            "(name them in --sampling-columns to)",
            unused,
        )

    try:  # an unknown model fails before Ray starts, naming the flag and the model
        model = resolve_model(config.engine.model)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"--model: {exc}") from exc
    checked = check_input(source)
    try:  # a model the engine would run wrong is refused here too (actors/architectures.py)
        max_model_len, vocab_size = model_facts(config.engine, model)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"--model {config.engine.model}: {exc}") from exc
    if config.compute.allocator == "tcmalloc":  # asked for by name: refused here when missing
        preload_env("tcmalloc")
    # Not written to here: a dry run writes nothing. A job's claim (`claim_output`, next after
    # this for every run) creates the folder and makes sure a file can be written in it.
    check_output(config.output, write=False)
    return PreparedJob(
        source=source,
        columns=tuple(columns),
        id_column=id_column,
        override_columns=overrides,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        num_partitions=config.plan.num_partitions or partitions_for(source.num_bytes),
        resolved_model=model,
        checked=checked,
    )


def partitions_for(num_bytes: int) -> int:
    """The plan's partitions when not set: one per `BYTES_PER_PARTITION` of input.

    Not at least one per engine actor, as it was: that put every input of two engine actors
    through Ray Data's hash shuffle (1,024 rows: read and plan 8.4 s against 4.5 s in one
    partition; docs/benchmarks-job-engine.md)."""
    return max(1, math.ceil(num_bytes / BYTES_PER_PARTITION))


def resolved_engines(config: JobConfig, prepared: PreparedJob) -> JobConfig:
    """The job's engine actors counted (`pipeline.job.engine_count`: "auto" from the nodes,
    the model and the rows); the count logged once with its reason."""
    import ray

    cluster = ray.cluster_resources() if ray.is_initialized() else {}
    config, reason = count_for_job(
        config, prepared.resolved_model, prepared.checked.num_rows, cluster
    )
    if reason is not None:
        logger.info("%d engine actor(s): %s", config.compute.num_actors, reason)
    return config


def claim_output(config: JobConfig, prepared: PreparedJob) -> OutputFolder:
    """Claim the output folder (`OutputFolder.claim`) and settle its lineage
    (`lineage.settle`: written on a first run; a folder another lineage produced is refused
    with LineageMismatch, untouched, unless `config.overwrite`). Released on a refusal."""
    record = lineage.job_lineage(
        config,
        prepared.id_column,
        prepared.override_columns,
        prepared.max_model_len,
        prepared.resolved_model,
    )
    folder = OutputFolder.claim(config.output)
    try:
        lineage.settle(folder, record, overwrite=config.overwrite)
    except BaseException:
        folder.release()
        raise
    return folder


def processor_config(config: JobConfig, prepared: PreparedJob) -> ProcessorConfig:
    """The job's options for the path it shares with the processor (`Processor.engine_rows`):
    its prompt, engine, sampling, text column, engine actors, compute options (torch
    threads, engine retries, restarts) and plan, with the partition count `prepare` chose;
    engine actors still "auto" are counted here (`resolved_engines`)."""
    if config.compute.num_actors == AUTO_ACTORS:
        config = resolved_engines(config, prepared)
    return ProcessorConfig.of_prompt(
        config.prompt,
        engine=config.engine,
        sampling=config.sampling,
        text_column=config.text_column,
        concurrency=config.compute.num_actors,
        plan=replace(config.plan, num_partitions=prepared.num_partitions),
        compute=config.compute,
    )


def job_processor(config: JobConfig, prepared: PreparedJob) -> Processor:
    """The processor whose path the job runs: its config, and the model facts and resolved
    model `prepare` found (handed to the tokenizer and engine stages as they are)."""
    rows = prepared.checked.num_rows
    return Processor(
        processor_config(config, prepared),
        facts=(prepared.max_model_len, prepared.vocab_size),
        resolved_model=prepared.resolved_model,
        rows=None if rows is None else rows * config.sampling.n,
    )


def id_rows(
    config: JobConfig,
    prepared: PreparedJob,
    done_ids: DoneIds | tuple[()] = (),
    collector=None,  # noqa: ANN001 (actor handle of StatsCollector)
):  # noqa: ANN201 (ray.data.Dataset)
    """The input read by Ray Data tasks and given the job's ids (`RowIdStage`: stable ids,
    those in `done_ids` dropped, rows registered with the `collector`)."""
    compute = config.compute
    ds = read_dataset(
        prepared.source,
        config.input.hf_split,
        compute.task_num_cpus,
        compute.rows_per_block,
        prepared.checked,
    )
    return ds.map_batches(
        RowIdStage(prepared.id_column, done_ids, collector),
        batch_format="pyarrow",
        batch_size=None,
        num_cpus=compute.task_num_cpus,
    )


def build_dataset(
    config: JobConfig,
    prepared: PreparedJob,
    done_ids: DoneIds | None = None,
    collector=None,  # noqa: ANN001 (actor handle of StatsCollector)
    infer_cls: type[InferStage] = InferStage,
    groups: EnginePlacements | None = None,
    progress: Any = None,
):  # noqa: ANN201 (ray.data.Dataset)
    """The lazy pipeline from the input to the engine's output rows (not yet written): read,
    the job's id stage (stable ids, ids already written dropped, rows registered with the
    `collector`), then the processor's path (`Processor.engine_rows`) with the job's keep
    columns carried, its collector, its tp x pp placement groups and its `progress` board."""
    ds = id_rows(config, prepared, done_ids or (), collector)
    ds = job_processor(config, prepared).engine_rows(
        ds,
        carry=config.input.keep_columns,
        collector=collector,
        placements=groups,
        infer_cls=infer_cls,
        progress=progress,
    )
    # Ray Data's per-operator reservations held the shuffle's second partition from the plan
    # until the engine had finished the first (1,024 rows in 2 partitions, one engine: plan
    # at 43.7 s, steps 65.3 s; without them 9.0 s and 63.0 s; docs/benchmarks-job-engine.md).
    # The shuffle takes every row before it gives any, so nothing upstream of it reads ahead
    # of it; the job's dataset runs without them, as the processor's does.
    return without_reservations(ds)


def check_room(config: JobConfig) -> EnginePlacements | None:
    """Fail fast (ValueError) where Ray would wait forever: engine groups or engine actors the
    nodes can never hold, or actors that leave no node a whole CPU (unless `wait_for_nodes`: an autoscaler
    adds nodes). For tp x pp engines, reserve their placement groups (TimeoutError when they
    are not placed in time) and return them."""
    import ray

    nodes = placement.node_resources()
    gpu = engine_placement.workers_use_gpus(config, ray.cluster_resources())
    check = not config.compute.wait_for_nodes  # nodes up now are all there will be
    if config.engine.world_size > 1:
        if check:
            engine_placement.check_groups_fit(config, gpu, nodes)
            engine_placement.check_cpu_room(config, gpu, nodes)
        return engine_placement.EnginePlacements(
            engine_placement.group_bundles(config, gpu),
            engine_placement.group_strategy(config),
            config.compute.num_actors,
            config.compute.placement_timeout_s,
            check_nodes=check,
        )
    if check:
        engine_placement.check_actors_fit(config, gpu, nodes)
        engine_placement.check_cpu_room(config, gpu, nodes)
    return None


def run_job(
    config: JobConfig,
    *,
    prepared: PreparedJob | None = None,
    infer_cls: type[InferStage] = InferStage,
    on_written: Callable[[Any], None] | None = None,
    folder: OutputFolder | None = None,
    watch: Callable[[Any, int], AbstractContextManager[Any]] | None = None,
    clock: JobClock | None = None,
) -> Summary:
    """Run the whole job into `config.output` (resuming what is there) and report.
    `on_written` gets the written Ray Dataset, executed (benchmarks read its per-operator
    stats: `get_stats_summary()`; not called when a rerun finds every row done: then no actor
    starts, see `rows_left`). `watch(board, rows_already_done)` is entered while the job
    runs, with a `pipeline.job.progress.ProgressBoard` the engine actors report to (the
    command's progress display: `pipeline.job.progress.watch`).

    The output folder is claimed for the run and its lineage settled (`claim_output`:
    OutputBusyError while another job holds it, LineageMismatch when another lineage produced
    it) unless the caller passes the `folder` it claimed that way.

    `clock`: the command's marks so far (pipeline/job/phases.py); the job adds its own and the
    engines', and the summary's `phases_s` has the phases they give."""
    if folder is None:
        prepared = prepared or prepare(config)
        with claim_output(config, prepared) as claimed:
            return run_job(
                config,
                prepared=prepared,
                infer_cls=infer_cls,
                on_written=on_written,
                folder=claimed,
                watch=watch,
                clock=clock,
            )
    started = time.perf_counter()
    timer = clock or JobClock(start=time.time())
    timer.mark("job")
    prepared = prepared or prepare(config)
    config = _resolved_dtype(config)
    config = resolved_engines(config, prepared)
    groups = check_room(config)  # before anything is written
    prefix = folder.filename_prefix()
    try:
        state = scan_output(config.output, prefix, retry_errors=config.retry_errors)
        storage.makedirs(config.output)
        done = done_filter(state.files, state.num_done)
        if rows_left(config, prepared, done, state.num_done) == 0:
            # A rerun with nothing to do starts no tokenizer, engine or writer actor.
            logger.info("every input row is already in %s: nothing to generate", config.output)
            timer.mark("written")
            committed, plan, engines = [], PlanStats(), None
        else:
            committed, plan, engines = _generate(
                config, prepared, done, groups, prefix, timer, infer_cls, on_written,
                watch, state.num_done,
            )  # fmt: skip
    finally:
        if groups is not None:
            groups.remove_all()
    summary, distributions = summarize(
        config.output, committed, plan, time.perf_counter() - started, state.num_done
    )

    def phases() -> dict[str, float]:
        timer.mark("reported")
        return timer.phases(engines)

    summary = write_report(config.output, summary, distributions, phases)
    # the command prints it (pipeline/commands/cli.py)
    logger.debug("summary: %s", summary.log_line())
    return summary


def rows_left(config: JobConfig, prepared: PreparedJob, done: DoneIds, num_done: int) -> int | None:
    """How many input rows are not in the output yet, counted only when the output already
    holds at least as many rows as `prepare` counted in the input (a rerun that may have
    nothing left; fewer rows done means some are surely left): read and id'd by Ray Data
    tasks exactly as the job does it (`RowIdStage`), without the job's actors. None when not
    counted. (A job with n > 1 samples per row writes n rows per id, so its reruns count.)"""
    total = prepared.checked.num_rows
    if num_done == 0 or total is None or num_done < total:
        return None
    return int(id_rows(config, prepared, done).count())


def _generate(
    config: JobConfig,
    prepared: PreparedJob,
    done: DoneIds,
    groups: EnginePlacements | None,
    prefix: str,
    timer: JobClock,
    infer_cls: type[InferStage],
    on_written: Callable[[Any], None] | None,
    watch: Callable[[Any, int], AbstractContextManager[Any]] | None,
    num_done: int,
) -> tuple[list[str], PlanStats, EngineMarks]:
    """Run the pipeline into the output folder: the files it committed, the plan's figures
    and the engines' marks (`run_job`'s work once there are rows to generate)."""
    import ray

    from pipeline.io.writer import ShardSink, default_num_writers

    collector = ray.remote(num_cpus=0)(StatsCollector).remote()
    board = ray.remote(num_cpus=0)(ProgressBoard).remote() if watch else None
    watching = watch(board, num_done) if watch else nullcontext()
    try:
        ds = build_dataset(config, prepared, done, collector, infer_cls, groups, board)
        # Writer actors gather the shards into files of FilesConfig's size, each visible
        # only when complete (pipeline/io/writer.py), named with the folder's job token: the
        # only files a rerun reads or deletes.
        sink = ShardSink(
            config.output,
            prefix,
            config.files,
            config.files.num_writers or default_num_writers(config.compute.num_engines),
        )
        with watching:
            written = sink.write(ds)
        timer.mark("written")
        plan = ray.get(collector.plan_total.remote())
        planned, engines = ray.get(collector.timing.remote())
        if planned is not None:
            timer.mark("planned", planned)
        if on_written is not None:
            on_written(written)
        del ds, written  # the executed datasets' per-block stats go with them
    finally:
        ray.kill(collector)
        if board is not None:
            ray.kill(board)
    return [path for path, _ in sink.committed], plan, engines


def _resolved_dtype(config: JobConfig) -> JobConfig:
    """`dtype="auto"` resolved once for the whole job, here where the cluster is known, so
    every engine actor runs (and the lineage records) one dtype: bfloat16 when the engines'
    workers hold GPUs, else what this machine's CPU computes natively (actors/dtypes.py; a
    cluster's CPU nodes are taken to be alike)."""
    import ray

    engine = config.engine
    if engine.dtype != "auto":
        return config
    if engine_placement.workers_use_gpus(config, ray.cluster_resources()):
        device = "cuda"
    else:
        device = "cpu"
    name, reason = choose_dtype("auto", device, cpu_info())
    logger.info("dtype %s for every engine (%s)", name, reason)
    return replace(config, engine=replace(engine, dtype=name))
