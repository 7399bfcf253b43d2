"""The engine actor stage: whole shard rows in, one output row per member out.

Each actor loads its engine once and keeps it across shards. A shard's prefix groups go to
`engine.generate` as `packing.PrefixGroup`s over the shard's prompts, so each shared prefix is
computed once. Rows that arrive with an error skip the engine and come out as they are.

If the actor process dies mid-shard, Ray restarts it (`max_restarts`) and runs the shard again
(`max_task_retries`); nothing of a shard is written until the whole shard is done, so a redo
cannot duplicate rows. An exception from the engine ends that shard's rows with `error` set
rather than failing the job.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence

import pyarrow as pa

from actors.config import EngineConfig, SamplingParams
from pipeline import stage
from pipeline.logs import setup_worker_logging
from pipeline.prompts import merge_sampling
from pipeline.stage import Stage

logger = logging.getLogger(__name__)


class InferStage(Stage):
    """Ray Data callable class for an actor pool; tests pass a ready `engine`."""

    name = "infer"

    def __init__(
        self,
        engine_config: EngineConfig,
        sampling: SamplingParams,
        *,
        text_column: str = "generated_text",
        keep_columns: Sequence[str] = (),
        torch_threads: int | None = None,
        engine=None,  # noqa: ANN001 (actors.LLMEngine or a stand-in)
    ):
        setup_worker_logging()
        if engine is None:
            import torch

            from actors import LLMEngine

            if torch_threads:
                torch.set_num_threads(torch_threads)
            started = time.perf_counter()
            engine = LLMEngine(engine_config)
            logger.info(
                "engine for %s loaded in %.1fs", engine_config.model, time.perf_counter() - started
            )
        self.engine = engine
        self.sampling = sampling
        self.text_column = text_column
        self.keep_columns = tuple(keep_columns)

    def required_columns(self) -> tuple[str, ...]:
        return (
            stage.SHARD,
            stage.ID,
            *self.keep_columns,
            stage.PROMPT_TOKEN_IDS,
            stage.NUM_PROMPT_TOKENS,
            stage.SAMPLING,
            stage.ERROR,
            stage.GROUP_SIZES,
            stage.GROUP_PREFIX_LENS,
        )

    def column_help(self) -> dict[str, str]:
        return {stage.SHARD: "one row per shard, from the plan stage"}

    def process(self, batch: pa.Table) -> pa.Table:
        if batch.num_rows == 0:  # keep the kept columns' types in the empty result
            return self._rows(batch, "", [], [], [], [], [], [])
        return pa.concat_tables([self.run_shard(batch.slice(i, 1)) for i in range(batch.num_rows)])

    def run_shard(self, shard: pa.Table) -> pa.Table:
        """One shard row -> its members' output rows."""
        from packing import PrefixGroup

        shard_id = shard.column(stage.SHARD)[0].as_py()
        members = {
            name: shard.column(name)[0].as_py()
            for name in (
                stage.ID,
                stage.PROMPT_TOKEN_IDS,
                stage.NUM_PROMPT_TOKENS,
                stage.SAMPLING,
                stage.ERROR,
            )
        }
        ids = members[stage.ID]
        errors: list[str | None] = list(members[stage.ERROR])
        sizes = shard.column(stage.GROUP_SIZES)[0].as_py()
        prefix_lens = shard.column(stage.GROUP_PREFIX_LENS)[0].as_py()

        runnable = [i for i, e in enumerate(errors) if e is None]
        position = {row: k for k, row in enumerate(runnable)}  # shard row -> prompt index
        group_of: list[int] = []
        shared_len: list[int] = []
        prefix_groups = []
        start = 0
        for g, (size, plen) in enumerate(zip(sizes, prefix_lens, strict=True)):
            rows = range(start, start + size)
            group_of.extend([g] * size)
            shared_len.extend([plen if size > 1 else 0] * size)
            in_run = [position[r] for r in rows if r in position]
            if plen > 0 and len(in_run) > 1:
                prefix_groups.append(PrefixGroup(plen, tuple(in_run)))
            start += size
        assert start == len(ids), f"shard {shard_id}: groups cover {start} of {len(ids)} rows"

        outputs = [None] * len(ids)
        started = time.perf_counter()
        if runnable:
            prompts = [members[stage.PROMPT_TOKEN_IDS][i] for i in runnable]
            params = [
                merge_sampling(self.sampling, json.loads(members[stage.SAMPLING][i] or "{}"))
                for i in runnable
            ]
            try:
                results = self.engine.generate(prompts, params, prefix_groups)
            except Exception as exc:  # an engine bug must not lose the other shards' work
                logger.exception("shard %s: the engine failed; its rows get an error", shard_id)
                for i in runnable:
                    errors[i] = f"engine failed: {type(exc).__name__}: {exc}"
            else:
                for i, out in zip(runnable, results, strict=True):
                    outputs[i] = out
        elapsed = time.perf_counter() - started
        table = self._rows(
            shard,
            shard_id,
            ids,
            members[stage.NUM_PROMPT_TOKENS],
            errors,
            outputs,
            group_of,
            shared_len,
        )
        self._log(shard_id, table, len(prefix_groups), elapsed)
        return table

    def _rows(
        self, shard, shard_id, ids, num_prompt, errors, outputs, group_of, shared_len
    ) -> pa.Table:  # noqa: ANN001, PLR0913
        text, token_ids, reasons, cached, generated, ttft = [], [], [], [], [], []
        for i, out in enumerate(outputs):
            if out is None:
                text.append(None)
                token_ids.append([])
                reasons.append("error")
                cached.append(0)
                generated.append(0)
                ttft.append(None)
                continue
            text.append(out.text)
            token_ids.append(list(out.token_ids))
            reasons.append(out.finish_reason)
            cached.append(out.num_cached_tokens)
            generated.append(len(out.token_ids))
            ttft.append(out.time_to_first_token)
            if out.error is not None:
                errors[i] = out.error
            num_prompt[i] = out.num_prompt_tokens or num_prompt[i]
        columns: dict[str, pa.Array] = {stage.ID: pa.array(ids, pa.string())}
        for name in self.keep_columns:
            columns[name] = shard.column(name).combine_chunks().flatten()
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
                stage.SHARD: pa.array([shard_id] * len(ids), pa.string()),
                stage.PREFIX_GROUP: pa.array([f"{shard_id}/{g}" for g in group_of], pa.string()),
                stage.SHARED_PREFIX_LEN: pa.array(shared_len, pa.int32()),
            }
        )
        return pa.table(columns)

    @staticmethod
    def _log(shard_id: str, table: pa.Table, num_groups: int, elapsed: float) -> None:
        generated = sum(table.column(stage.NUM_GENERATED_TOKENS).to_pylist())
        prompt = sum(table.column(stage.NUM_PROMPT_TOKENS).to_pylist())
        cached = sum(table.column(stage.NUM_CACHED_TOKENS).to_pylist())
        errors = table.num_rows - table.column(stage.ERROR).null_count
        logger.info(
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
