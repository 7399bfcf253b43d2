"""The engine actor stage: whole shard rows in, one output row per member (per sample) out.

Each actor loads its engine once and keeps it across shards. The actor runs several shard
tasks at once (`max_concurrent_calls_per_actor` in pipeline/processor/build.py); each hands its shard to
one `pipeline.stages.feed.EngineFeed`, whose thread steps the engine and queues a new shard's
prompts between two steps, so the running batch stays full across shard boundaries. An actor
of several engines (`engines`: `ComputeConfig.engines_per_actor`) has a feed per engine and
hands each shard to the feed with the fewest rows still to finish; the engines after the
first run on its weights (`LLMEngine(weights_from=)`: loaded and packed once). A shard's
prefix groups (nested when the plan made them so) go to `engine.add_prompts` as
`packing.PrefixGroup`s over the shard's prompts, so each shared prefix is computed once. Rows
that arrive with an error skip the engine and come out as they are.

If the actor process dies mid-shard, Ray restarts it (`max_restarts`) and runs its shards
again (`max_task_retries`); nothing of a shard is returned (so written) until its last row is
done, so a redo cannot duplicate rows. A tensor/pipeline-parallel engine whose worker dies
mid-step raises `WorkerFailedError` (and tears its workers down): the feed builds a fresh
engine (new workers, in the same placement group) and redoes the shards that were in it, up
to `engine_retries` times each; past that the error fails the job, with the cause, rather
than losing the shard. Any other exception from the engine ends the rows of the shards in it
with `error` set rather than failing the job.

A row with several samples (`SamplingParams.n` > 1) gives one output row per sample, each
with the row's id and its `sample_index` (0..n-1), in one shard: a shard is written whole, so
a row is either done with all its samples or not at all (a resumed job never writes a sample
twice). An error row is one row, sample_index 0.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

import pyarrow as pa

from actors.config import EngineConfig, SamplingParams
from actors.loader import ResolvedModel
from actors.outputs import RequestOutput
from actors.parallel.errors import WorkerFailedError
from pipeline.job.phases import EngineMarks, process_start
from pipeline.job.progress import ProgressReporter
from pipeline.stages import group_columns, stage
from pipeline.stages.feed import EngineFeed
from pipeline.stages.group_columns import ShardGroups
from pipeline.stages.logs import setup_worker_logging
from pipeline.stages.parsed import PARSED, parsed_column
from pipeline.stages.prompts import merge_sampling
from pipeline.stages.stage import Stage

logger = logging.getLogger(__name__)

_ACTOR = f"{socket.gethostname()}:{os.getpid()}"  # this process, for the job's phases

_TOP = pa.list_(pa.struct([("token_id", pa.int32()), ("logprob", pa.float64())]))
LOGPROBS_TYPE = pa.list_(
    pa.struct([("token_id", pa.int32()), ("logprob", pa.float64()), ("top", _TOP)])
)


class InferStage(Stage):
    """Ray Data callable class for an actor pool; tests pass a ready `engine`. With
    `with_logprobs`, each row also gets its per-token `logprobs` (token id, log-probability,
    and the top alternatives; null for an error row); with `with_samples`, a
    `sample_index` column (rows with n > 1 need it: their samples share the row's id)."""

    name = "infer"

    def __init__(
        self,
        engine_config: EngineConfig,
        sampling: SamplingParams,
        *,
        text_column: str = "generated_text",
        keep_columns: Sequence[str] = (),
        torch_threads: int | None = None,
        engine_retries: int = 1,
        with_logprobs: bool = False,
        with_samples: bool = False,
        progress=None,  # noqa: ANN001 (actor handle of pipeline.job.progress.ProgressBoard)
        parsed_type: pa.DataType | None = None,
        resolved_model: ResolvedModel | None = None,
        tokenizer=None,  # noqa: ANN001 (HF tokenizer the driver loaded, or None: load it)
        engine=None,  # noqa: ANN001 (actors.LLMEngine or a stand-in)
        timeline=None,  # noqa: ANN001 (actor handle of pipeline.io.report.StatsCollector)
        engines: int = 1,
    ):
        # The job's phases (pipeline/job/phases.py): this actor's marks go to `timeline`.
        self.marks = EngineMarks(process=process_start(), constructed=time.time())
        self.timeline = timeline
        setup_worker_logging()
        self.engine_config = engine_config
        self.resolved_model = resolved_model  # engine_config.model as the driver resolved it
        self.tokenizer = tokenizer  # the driver's (pickled here), so the engine loads none
        self.sampling = sampling
        self.text_column = text_column
        self.keep_columns = tuple(keep_columns)
        self.with_logprobs = with_logprobs
        self.with_samples = with_samples
        # The job's live progress: each row counted as its request ends (pipeline/job/progress.py).
        self.progress = ProgressReporter(progress) if progress is not None else None
        self.parsed_type = parsed_type  # the `parsed` column's (pipeline/stages/parsed.py), or none
        self._build_lock = threading.Lock()  # `_new_engine`'s

        def new_feed(build, built=None) -> EngineFeed:  # noqa: ANN001 (an engine or None)
            return EngineFeed(
                built,
                build,
                _close_engine,
                engine_retries=engine_retries,
                torch_threads=torch_threads,
                on_finished=self.progress.finished if self.progress else None,
            )  # given no engine, the feed builds one in its own thread (pipeline/stages/feed.py)

        self.feeds = [new_feed(self._new_engine, engine)]
        if engine is None:  # the others beside the first, each in its own feed's thread
            first = self.feeds[0].engine
            self.feeds += [new_feed(partial(self._new_engine, first)) for _ in range(engines - 1)]
        self._unfinished = [0] * len(self.feeds)  # rows (samples) each feed has yet to finish
        self._route = threading.Lock()
        self.marks.loaded = time.time()

    @property
    def engine(self):  # noqa: ANN201 (actors.LLMEngine)
        """The (first) engine now in use (a worker failure replaces it)."""
        return self.feeds[0].engine

    def _new_engine(self, beside=None):  # noqa: ANN001, ANN202 (actors.LLMEngine)
        """An engine for this actor; `beside` (the actor's first engine, for the others): on
        its weights when it can share them (no second load or packing, the weights held
        once), else loaded as it was."""
        import torch

        from actors import LLMEngine

        started = time.perf_counter()  # the feed's thread, the collector paused (feed.py)
        if beside is not None and beside.shares_weights:
            engine = LLMEngine(self.engine_config, weights_from=beside)
            logger.info("engine on the first's weights in %.2fs", time.perf_counter() - started)
            return engine
        # One load at a time: transformers' `from_pretrained` is not thread-safe (two at once
        # in one process: "Cannot copy out of meta tensor" from one whose weights the
        # other's meta-device context made).
        with self._build_lock:
            engine = LLMEngine(
                self.engine_config, tokenizer=self.tokenizer, resolved_model=self.resolved_model
            )
        logger.info(
            "engine for %s loaded in %.1fs (%d torch threads)",
            self.engine_config.model,
            time.perf_counter() - started,
            torch.get_num_threads(),
        )
        return engine

    def _generate(self, shard_id: str, prompts: list, params: list, groups: list) -> list:
        """The shard's outputs, through the feed (other shards run in the same batch); a
        stand-in engine with only `generate` (unit tests) is called directly."""
        if not hasattr(self.engine, "add_prompts"):
            outputs = self.engine.generate(prompts, params, groups)
            if self.progress is not None:
                done = iter(outputs)  # `n` per prompt
                for p in params:
                    self.progress.finished([next(done) for _ in range(p.n)])
            return outputs
        samples = sum(p.n for p in params)
        with self._route:  # the feed with the fewest rows to finish takes the shard
            pick = min(range(len(self.feeds)), key=self._unfinished.__getitem__)
            self._unfinished[pick] += samples
        try:
            return self.feeds[pick].generate(shard_id, prompts, params, groups)
        finally:
            with self._route:
                self._unfinished[pick] -= samples

    def required_columns(self) -> tuple[str, ...]:
        return (
            stage.SHARD,
            stage.ID,
            *self.keep_columns,
            stage.PROMPT_TOKEN_IDS,
            stage.NUM_PROMPT_TOKENS,
            stage.SAMPLING,
            stage.ERROR,
            *group_columns.COLUMNS,
        )

    def column_help(self) -> dict[str, str]:
        return {stage.SHARD: "one row per shard, from the plan stage"}

    def process(self, batch: pa.Table) -> pa.Table:
        if batch.num_rows == 0:  # keep the kept columns' types in the empty result
            return self._rows(batch, "", _Members.of(batch), [], [], ShardGroups())
        return pa.concat_tables([self.run_shard(batch.slice(i, 1)) for i in range(batch.num_rows)])

    def run_shard(self, shard: pa.Table) -> pa.Table:
        """One shard row -> its members' output rows."""
        shard_id = shard.column(stage.SHARD)[0].as_py()
        members = _Members.of(shard)
        runnable = [i for i, e in enumerate(members.errors) if e is None]
        groups = group_columns.read_groups(shard)
        assert groups.num_rows == len(members.ids), (
            f"groups cover {groups.num_rows} of {len(members.ids)} rows"
        )
        # The planner puts rows with an error in shards of their own, so in a shard with
        # groups every row reaches the engine and shard row i is prompt i.
        assert len(runnable) == len(members.ids) or not groups.engine
        outputs: list[list[RequestOutput]] = [[] for _ in members.ids]  # per member, n each
        started = time.perf_counter()
        if runnable:
            prompts = [members.token_ids[i] for i in runnable]
            params = [
                merge_sampling(self.sampling, json.loads(members.sampling[i] or "{}"))
                for i in runnable
            ]
            try:
                results = self._generate(shard_id, prompts, params, list(groups.engine))
            except WorkerFailedError:
                raise  # retries spent: fail the job with the cause, lose no rows silently
            except Exception as exc:  # an engine bug must not lose the other shards' work
                logger.exception("shard %s: the engine failed; its rows get an error", shard_id)
                for i in runnable:
                    members.errors[i] = f"engine failed: {type(exc).__name__}: {exc}"
            else:
                done = iter(results)
                for i, p in zip(runnable, params, strict=True):
                    outputs[i] = [next(done) for _ in range(p.n)]
                # The config asks for the column whenever a row can have n > 1.
                assert self.with_samples or all(len(o) <= 1 for o in outputs)
        if self.progress is not None:
            # Rows without an engine output (an error before the engine, or the engine's
            # failure) are done too, each with its error.
            failed = sum(1 for outs in outputs if not outs)
            self.progress.add(rows=failed, errors=failed)
            self.progress.flush()
        rows = [i for i, outs in enumerate(outputs) for _ in range(max(1, len(outs)))]
        flat = [out for outs in outputs for out in (outs or [None])]
        table = self._rows(shard, shard_id, members, rows, flat, groups)
        self._log(shard_id, table, len(groups.engine), time.perf_counter() - started)
        if self.timeline is not None:
            self.marks.first_step = min(
                (f.first_step_at for f in self.feeds if f.first_step_at), default=None
            )
            self.marks.last_step = max(
                (f.last_step_at for f in self.feeds if f.last_step_at), default=None
            )
            self.timeline.record_engine.remote(_ACTOR, replace(self.marks))
        return table

    def _rows(
        self,
        shard: pa.Table,
        shard_id: str,
        members: _Members,
        rows: list[int],  # per output row, its member (a member has a row per sample)
        outputs: list[RequestOutput | None],
        groups: ShardGroups,
    ) -> pa.Table:
        n = len(rows)
        errors = [members.errors[m] for m in rows]
        num_prompt = [members.num_prompt_tokens[m] for m in rows]
        text: list[str | None] = [None] * n
        token_ids: list[list[int]] = [[] for _ in range(n)]
        reasons = ["error"] * n
        cached, generated = [0] * n, [0] * n
        ttft: list[float | None] = [None] * n
        for i, out in enumerate(outputs):
            if out is None:
                continue
            text[i], token_ids[i], reasons[i] = out.text, list(out.token_ids), out.finish_reason
            cached[i], generated[i] = out.num_cached_tokens, len(out.token_ids)
            ttft[i] = out.time_to_first_token
            errors[i] = out.error if out.error is not None else errors[i]
            num_prompt[i] = out.num_prompt_tokens or num_prompt[i]
        ids = [members.ids[m] for m in rows]
        columns: dict[str, pa.Array] = {stage.ID: pa.array(ids, pa.string())}
        if self.with_samples:
            samples = [0 if out is None else out.sample_index for out in outputs]
            columns[stage.SAMPLE_INDEX] = pa.array(samples, pa.int32())
        for name in self.keep_columns:
            kept = shard.column(name).combine_chunks().flatten()
            columns[name] = kept if rows == list(range(len(kept))) else kept.take(rows)
        first_level, shared = groups.first_level_of_rows(), groups.shared_prefix_lens()
        columns.update(
            {
                self.text_column: pa.array(text, pa.string()),
                stage.GENERATED_TOKEN_IDS: pa.array(token_ids, stage.TOKEN_LIST),
                stage.FINISH_REASON: pa.array(reasons, pa.string()),
                stage.NUM_PROMPT_TOKENS: pa.array(num_prompt, pa.int32()),
                stage.NUM_CACHED_TOKENS: pa.array(cached, pa.int32()),
                stage.NUM_GENERATED_TOKENS: pa.array(generated, pa.int32()),
                stage.TTFT: pa.array(ttft, pa.float64()),
                stage.ERROR: pa.array(errors, pa.string()),
                stage.SHARD: pa.array([shard_id] * n, pa.string()),
                stage.PREFIX_GROUP: pa.array(
                    [f"{shard_id}/{first_level[m]}" for m in rows], pa.string()
                ),
                stage.SHARED_PREFIX_LEN: pa.array([shared[m] for m in rows], pa.int32()),
            }
        )
        if self.with_logprobs:
            columns[stage.LOGPROBS] = pa.array([_logprobs(out) for out in outputs], LOGPROBS_TYPE)
        if self.parsed_type is not None:
            columns[PARSED] = parsed_column(text, self.parsed_type)
        return pa.table(columns)

    @staticmethod
    def _log(shard_id: str, table: pa.Table, num_groups: int, elapsed: float) -> None:
        generated = sum(table.column(stage.NUM_GENERATED_TOKENS).to_pylist())
        prompt = sum(table.column(stage.NUM_PROMPT_TOKENS).to_pylist())
        cached = sum(table.column(stage.NUM_CACHED_TOKENS).to_pylist())
        errors = table.num_rows - table.column(stage.ERROR).null_count
        # DEBUG: the job's progress line (pipeline/job/progress.py) says how far it is.
        logger.debug(
            "shard %s: %d rows (%d errors), %d shared prefix groups, %d prompt tokens "
            "(%d cached), %d generated in %.1fs (%.1f tok/s)",
            shard_id,
            table.num_rows,
            errors,
            num_groups,
            prompt,
            cached,
            generated,
            elapsed,
            generated / elapsed if elapsed > 0 else 0.0,
        )


def _logprobs(out: RequestOutput | None) -> list[dict] | None:
    if out is None or out.logprobs is None:
        return None
    return [
        {
            "token_id": lp.token_id,
            "logprob": lp.logprob,
            "top": [{"token_id": t, "logprob": p} for t, p in lp.top],
        }
        for lp in out.logprobs
    ]


def _close_engine(engine) -> None:  # noqa: ANN001 (actors.LLMEngine)
    """Stop the engine's workers, if it has any (a failed one already has)."""
    shutdown = getattr(getattr(engine, "runner", None), "shutdown", None)
    if shutdown is not None:
        shutdown()


@dataclass
class _Members:
    """A shard row's list columns as Python lists (errors is filled in as rows fail)."""

    ids: list[str]
    token_ids: list[list[int]]
    num_prompt_tokens: list[int]
    sampling: list[str | None]
    errors: list[str | None]

    @classmethod
    def of(cls, shard: pa.Table) -> _Members:
        """The members of the first shard row (all empty for an empty table)."""
        names = (
            stage.ID,
            stage.PROMPT_TOKEN_IDS,
            stage.NUM_PROMPT_TOKENS,
            stage.SAMPLING,
            stage.ERROR,
        )
        if shard.num_rows == 0:
            return cls([], [], [], [], [])
        return cls(*(list(shard.column(name)[0].as_py()) for name in names))
