"""raypack inside a user's own Ray Data program: `build_processor(config)(ds)`, and the path
from keyed rows to the engine's rows that the offline job runs too (`Processor.engine_rows`).

    ds -> intake (a key per row; the input columns set aside, unchanged)
       -> engine_rows: prompt tokens (TokenizeStage, or TokenIdsStage for token-id prompts)
          -> shuffle by prefix key -> plan (PlanStage: prefix groups, shards)
          -> one shard per block -> engine actors (InferStage and its continuous feed)
       -> outflow (the input columns back, plus the generated columns)

The offline job (pipeline/job/run.py) is read -> its id stage (stable ids, done ids skipped)
-> `engine_rows` -> its writer: the same code between its own ends.

Every operator is Ray Data's own (`map_batches` with tasks or an actor pool, `repartition`),
so the result is a lazy, streaming `ray.data.Dataset` the program goes on with: filter it,
join it, write it to any sink. A row that cannot run comes out with `error` set; it never
stops the dataset.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from actors.config import EngineConfig
from actors.loader import ResolvedModel, resolve_model
from pipeline.processor.config import ProcessorConfig
from pipeline.processor.datasets import check_schema, first_row_per_key, without_reservations
from pipeline.processor.ray_llm import (
    SAMPLING_PARAMS,
    ChatPromptStage,
    LLMProcessorConfig,
    RayColumnsStage,
)
from pipeline.processor.stages import INPUT, IntakeStage, OutflowStage, TokenIdsStage
from pipeline.stages import dedupe, stage
from pipeline.stages.engine_actor import (
    ShardSpread,
    default_torch_threads,
    engine_actor_args,
    shards_in_flight,
)
from pipeline.stages.infer import InferStage
from pipeline.stages.tokenize import TokenizeStage

__all__ = [
    "LLMProcessorConfig",
    "Processor",
    "ProcessorConfig",
    "build_processor",
    "model_facts",
]
Row = dict[str, Any]


class Processor:
    """`processor(ds)` -> a lazy dataset: every input column once per row, unchanged, plus
    the text column (`generated_text`), `generated_token_ids`, `num_prompt_tokens`,
    `num_generated_tokens`, `finish_reason`, `error` (null on success) and `logprobs` when
    asked. `engine_rows` is the path in between, which the offline job runs too.

    `facts` (context length, vocabulary size) when the caller has read them already
    (`model_facts`), and `resolved_model` when it has resolved the engine's model (the job's
    `prepare`); else each is found once, on first use, and handed to the stages that read
    the model (tokenizer and engine actors). `preprocess` / `postprocess` (Ray Data
    LLM's): a function of a row applied before (`ds.map`) and after; `before` a stage run on
    the rows the preprocess returns; `ray_columns` renames the output columns as Ray Data LLM
    names them (`pipeline.processor.ray_llm`). `rows`: the sequences the caller expects, when
    it knows them (the job does), so that several engine actors share the shards evenly
    (`shards_in_flight`)."""

    def __init__(
        self,
        config: ProcessorConfig,
        *,
        facts: tuple[int, int] | None = None,
        resolved_model: ResolvedModel | None = None,
        preprocess: Callable[[Row], Row] | None = None,
        postprocess: Callable[[Row], Row] | None = None,
        before: ChatPromptStage | None = None,
        ray_columns: RayColumnsStage | None = None,
        rows: int | None = None,
    ):
        self.config = config
        self.rows = rows  # the sequences the caller expects (the job counts them), else None
        self._model = facts
        self._resolved_model = resolved_model
        self._loaded_tokenizer: tuple[Any] | None = None  # (`_driver_tokenizer`'s answer,)
        self.preprocess = preprocess
        self.postprocess = postprocess
        self.before = before
        self.ray_columns = ray_columns

    def __call__(self, ds):  # noqa: ANN001, ANN204 (ray.data.Dataset in and out)
        if self.preprocess is not None:
            ds = ds.map(_with_sampling_params(self.preprocess))
        if self.before is not None:
            ds = ds.map_batches(
                self.before,
                batch_format="pyarrow",
                batch_size=256,
                num_cpus=self.config.compute.task_num_cpus,
            )
        ds = self._generate(ds)
        if self.ray_columns is not None:
            ds = ds.map_batches(
                self.ray_columns,
                batch_format="pyarrow",
                batch_size=None,
                num_cpus=self.config.compute.task_num_cpus,
            )
        if self.postprocess is not None:
            ds = ds.map(self.postprocess)
        return without_reservations(ds)

    def _generate(self, ds):  # noqa: ANN001, ANN202 (ray.data.Dataset in and out)
        import ray

        config = self.config
        if config.engine.world_size > 1:
            raise ValueError(
                "the processor runs single-process engines; tensor/pipeline-parallel engines "
                "(tensor_parallel_size x pipeline_parallel_size > 1) run through raypack generate"
            )
        for name in config.source_columns:
            if name == stage.ID:  # the intake keys rows by `id`
                raise ValueError(
                    f"a prompt built from a column named {stage.ID!r} is not supported: "
                    "rename the column (ds.rename_columns)"
                )
        if not ray.is_initialized():  # as Ray Data itself would on first use
            ray.init()
        outputs = config.output_columns
        needed = {c: "the prompt source or a sampling override" for c in config.source_columns}
        if config.id_column:
            needed.setdefault(config.id_column, "the id column")
        check_schema(ds, needed, outputs)
        ds = ds.map_batches(
            IntakeStage(needed, outputs, config.source_columns),
            batch_format="pyarrow",
            batch_size=None,
            num_cpus=config.compute.task_num_cpus,
        )
        ds = self.engine_rows(ds, carry=(INPUT,))
        return ds.map_batches(
            OutflowStage(outputs),
            batch_format="pyarrow",
            batch_size=None,
            num_cpus=config.compute.task_num_cpus,
        )

    def engine_rows(
        self,
        ds,  # noqa: ANN001 (ray.data.Dataset)
        *,
        carry: Sequence[str] = (),
        collector: Any = None,
        placements: Any = None,
        infer_cls: type[InferStage] = InferStage,
        progress: Any = None,
    ):  # noqa: ANN201 (ray.data.Dataset)
        """The one path from keyed rows to the engine's rows, for the processor and the
        offline job alike:

            tokenize (CPU actors; token ids as they are for `token_ids_column`)
              -> shuffle by prefix key (`num_partitions` hash partitions; one: no shuffle)
              -> plan (prefix groups, shards) -> one shard per block
              -> engine actors (several shards each at once, pipeline/stages/feed.py)

        `ds` has an `id` per row (the processor's intake or the job's id stage) and the
        prompt's source columns. `carry` columns travel unchanged to the engine's rows, which
        have: id, the carried columns, the text column, generated_token_ids, finish_reason,
        num_prompt_tokens, num_cached_tokens, num_generated_tokens, time_to_first_token_s,
        error, shard, prefix_group, shared_prefix_len, and logprobs when asked.

        The offline job's own parts: `collector` (its `StatsCollector` handle: the plan
        sends it each partition's figures and keeps one row per id across partitions, by the
        id stage's content column `dedupe.CONTENT`, carried to the plan for it);
        `placements` (`EnginePlacements`, a placement group per tp x pp engine actor);
        `infer_cls` (the engine stage; tests subclass it to kill actors); `progress` (a
        `pipeline.job.progress.ProgressBoard` handle the engine actors report finished rows to)."""
        import ray.data

        config, compute = self.config, self.config.compute_config
        carry = tuple(carry)
        tokenizer_cls, tokenizer_args = self._tokenizer(
            (*carry, dedupe.CONTENT) if collector is not None else carry
        )
        ds = ds.map_batches(
            tokenizer_cls,
            **tokenizer_args,
            batch_format="pyarrow",
            batch_size=256,
            compute=ray.data.ActorPoolStrategy(size=compute.num_tokenize_actors),
            num_cpus=compute.tokenize_num_cpus,
        )
        in_flight, spread = self.shard_dispatch()
        if config.plan.prefix_grouping:
            # Hash partitions by prefix key: rows that can share a prefix meet in one
            # partition (Ray's groupby().map_groups() is this repartition plus batch_size=None).
            # One partition holds every row anyway: no keyed shuffle (its map and reduce
            # operators cost seconds on small inputs; see bench_pipeline).
            partitions = config.num_partitions
            ds = (
                ds.repartition(1)
                if partitions == 1
                else ds.repartition(partitions, keys=[stage.SHUFFLE_KEY])
            )
        ds = ds.map_batches(
            _plan_stage(config, carry, collector, spread),
            batch_format="pyarrow",
            batch_size=None,  # a whole partition: its groups are complete
            num_cpus=compute.task_num_cpus,
        )
        # One shard per block, so one actor task is one shard: an actor that dies redoes only it.
        ds = ds.repartition(target_num_rows_per_block=1)
        args = engine_actor_args(compute, placements)
        threads = default_torch_threads(compute, args, config.engine.world_size)
        calls = in_flight * compute.engines_each  # an actor's engines' shards together
        with warnings.catch_warnings():
            # max_restarts / max_task_retries have no named parameter in map_batches (2.60),
            # and Ray Data's default is to retry forever: a shard that kills its actor every
            # time would never end the job. Bounded retries are worth the deprecation warning,
            # and so is a placement group per engine actor (as ray.data.llm does).
            warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
            warnings.filterwarnings("ignore", message="`ray_remote_args_fn` is deprecated")
            return ds.map_batches(
                infer_cls,
                fn_constructor_args=(config.engine, config.sampling),
                fn_constructor_kwargs=dict(
                    resolved_model=self.resolved_model(),
                    tokenizer=self._driver_tokenizer(),
                    text_column=config.text_column,
                    keep_columns=carry,
                    torch_threads=compute.torch_threads or threads,
                    engine_retries=compute.engine_retries,
                    engines=compute.engines_each,
                    with_logprobs=config.with_logprobs,
                    with_samples=config.with_samples,
                    **({"progress": progress} if progress is not None else {}),
                    # the engine actors' marks, for the job's phases (pipeline/job/phases.py)
                    **({"timeline": collector} if collector is not None else {}),
                    parsed_type=config.parsed_type,
                ),
                batch_format="pyarrow",
                batch_size=1,
                compute=ray.data.ActorPoolStrategy(
                    min_size=config.actor_pool_size[0],
                    max_size=config.actor_pool_size[1],
                    # Several shards in one actor at once, so the next shard's prompts join
                    # the running batch while the last ones decode (pipeline/stages/feed.py).
                    max_concurrent_calls_per_actor=calls,
                    max_tasks_in_flight_per_actor=calls,
                    enable_true_multi_threading=True,
                ),
                **args,
            )

    def shard_dispatch(self) -> tuple[int, ShardSpread | None]:
        """Shards one engine holds at once (`shards_in_flight`, capped by its share of `rows`
        when the caller knows them), and how the plan spreads a small partition's shards over
        all the engines (`ShardSpread`; None for one engine, or without the shuffle by prefix
        key, whose partitions are the input's blocks). An actor of several engines
        (`ComputeConfig.engines_per_actor`) holds as many shards as they do together."""
        config = self.config
        each = config.compute_config.engines_each
        low, high = (size * each for size in config.actor_pool_size)
        share = None if self.rows is None or low == 1 else math.ceil(self.rows / low)
        in_flight = shards_in_flight(config.engine, config.plan, share)
        if high == 1 or not config.plan.prefix_grouping:
            return in_flight, None
        return in_flight, ShardSpread(config.num_partitions, high, in_flight)

    def retry_errors(self, ds):  # noqa: ANN001, ANN201 (ray.data.Dataset in and out)
        """The processor's `--retry-errors`: `ds` is a dataset this processor returned (its
        rows possibly changed since, e.g. a fixed override column). Rows whose `error` is null
        pass through as they are, nothing redone; the others lose their generated columns and
        run again. Every row comes back once (in no particular order, as `union` gives).

        When a row can have several samples (`sample_index`), a row with an error in any of
        its samples runs again once, its other samples dropped: it comes back once per sample
        index, never beside its old samples. Its samples are told apart from other rows' by
        `id_column` (ValueError without one, or for an error row whose id is null).

        With no error row, `ds` comes back as it is and no actor starts.

        `ds` is materialized first: the rows kept and the rows retried are both read from it,
        and a lazy `ds` would otherwise be computed once for each (a user's map that does not
        give the same rows twice, e.g. a row that fails only sometimes, could then be kept
        and retried too, or neither)."""
        from ray.data.expressions import col

        ds = ds.materialize()
        outputs = list(self.config.output_columns)
        names = list(ds.schema().names)
        missing = [c for c in outputs if c not in names]
        if missing:
            raise ValueError(
                f"retry_errors takes a dataset this processor returned; it has no {missing} "
                f"columns. Its columns: {names}"
            )
        if not self.config.with_samples:
            failed = ds.filter(expr=col(stage.ERROR).is_not_null()).materialize()
            if failed.count() == 0:  # nothing to redo: no tokenizer or engine actor started
                return ds
            kept = ds.filter(expr=col(stage.ERROR).is_null())
            return kept.union(self(failed.drop_columns(outputs)))
        key = self.config.id_column
        if key is None:
            raise ValueError(
                "retry_errors on rows with several samples (n > 1) needs the processor's "
                "id_column: a row whose sample has an error runs again with all its samples, "
                "and its other samples are found by its id"
            )
        errors = ds.filter(expr=col(stage.ERROR).is_not_null()).select_columns([key])
        failed_ids = errors.unique(key)
        if not failed_ids:
            return ds
        if None in failed_ids:  # its samples cannot be told from other null-id rows' samples
            raise ValueError(
                f"retry_errors: rows with an error have a null {key!r} (the id_column); give "
                "them ids to retry them"
            )
        kept = ds.filter(expr=col(key).not_in(failed_ids))
        failed = (
            ds.filter(expr=col(key).is_in(failed_ids))
            .repartition(1)
            .map_batches(
                first_row_per_key,
                fn_kwargs={"key": key},
                batch_format="pyarrow",
                batch_size=None,
                num_cpus=self.config.compute.task_num_cpus,
            )
            .drop_columns(outputs)
        )
        return kept.union(self(failed))

    def resolved_model(self) -> ResolvedModel:
        """The engine's model resolved into its files (once, on the driver)."""
        if self._resolved_model is None:
            self._resolved_model = resolve_model(self.config.engine.model)
        return self._resolved_model

    def model_facts(self) -> tuple[int, int]:
        """The model's context length and vocabulary size (read once, on the driver)."""
        if self._model is None:
            self._model = model_facts(self.config.engine, self.resolved_model())
        return self._model

    def _tokenizer(self, carry: tuple[str, ...]) -> tuple[type, dict]:
        """The prompt-token stage and its arguments; `carry` passes through it."""
        config = self.config
        max_model_len, vocab_size = self.model_facts()
        if config.token_ids_column:
            return TokenIdsStage, dict(
                fn_constructor_args=(config.token_ids_column,),
                fn_constructor_kwargs=dict(
                    max_model_len=max_model_len,
                    vocab_size=vocab_size,
                    sampling=config.sampling,
                    keep_columns=carry,
                    override_columns=config.override_columns,
                    sampling_column=config.sampling_column,
                    key_block_size=config.plan.key_block_size,
                ),
            )
        return TokenizeStage, dict(
            fn_constructor_args=(config.prompt,),
            fn_constructor_kwargs=dict(
                model=self.resolved_model(),
                max_model_len=max_model_len,
                sampling=config.sampling,
                keep_columns=carry,
                override_columns=config.override_columns,
                key_block_size=config.plan.key_block_size,
                trust_remote_code=config.engine.trust_remote_code,
                tokenizer=self._driver_tokenizer(),
            ),
        )

    def _driver_tokenizer(self) -> Any:
        """The tokenizer, loaded once here on the driver for the tokenizer and engine actors
        (pickled to them), or None for them to load it themselves. Loading it in a fresh
        tokenizer actor costs ~2 s on a 2-core machine, most of it transformers importing
        torch and torch._dynamo through AutoConfig; unpickling it there costs ~0.7 s and
        imports no torch. An engine actor has transformers imported anyway: there loading it
        took 0.1-0.3 s of CPU (tokenizer.json parsed twice), unpickling it 0.06-0.08 s. The
        driver has imported transformers already (`model_facts`), so here it costs ~0.15 s,
        once. A trust_remote_code tokenizer (its class from the model's own code) and one that
        does not pickle are loaded by the actors, as before."""
        if self._loaded_tokenizer is None:
            self._loaded_tokenizer = (self._load_driver_tokenizer(),)
        return self._loaded_tokenizer[0]

    def _load_driver_tokenizer(self) -> Any:
        if self.config.engine.trust_remote_code:
            return None
        import pickle

        from actors.loader import load_tokenizer

        tokenizer = load_tokenizer(self.resolved_model())
        try:
            pickle.dumps(tokenizer)
        except Exception:  # noqa: BLE001 (any tokenizer that cannot travel: the actors load it)
            return None
        return tokenizer


def build_processor(
    config: ProcessorConfig | LLMProcessorConfig,
    preprocess: Callable[[Row], Row] | None = None,
    postprocess: Callable[[Row], Row] | None = None,
) -> Processor:
    """The processor for `config`: call it on a `ray.data.Dataset` (see `Processor`). With
    an `LLMProcessorConfig` (Ray Data LLM's call shape, `pipeline.processor.ray_llm`), rows come out
    with Ray Data LLM's column names; `preprocess` and `postprocess` work with either."""
    if isinstance(config, LLMProcessorConfig):
        inner = config.processor_config()
        return Processor(
            inner,
            preprocess=preprocess,
            postprocess=postprocess,
            before=ChatPromptStage(inner) if inner.messages_column else None,
            ray_columns=RayColumnsStage(detokenize=config.detokenize),
        )
    return Processor(config, preprocess=preprocess, postprocess=postprocess)


def _with_sampling_params(preprocess: Callable[[Row], Row]) -> Callable[[Row], Row]:
    """The preprocess, its rows given a null `sampling_params` when it sets none (Ray Data
    LLM's rows may leave it out: the defaults apply)."""

    def run(row: Row) -> Row:
        out = preprocess(row)
        if isinstance(out, dict) and SAMPLING_PARAMS not in out:
            out = {**out, SAMPLING_PARAMS: None}
        return out

    return run


def model_facts(
    engine: EngineConfig, resolved_model: ResolvedModel | None = None
) -> tuple[int, int]:
    """(context length, vocabulary size) of the engine's model (`resolved_model` when the
    caller resolved it): `max_model_len` when set, else the model config's
    `max_position_embeddings`; FileNotFoundError for no model, and
    `actors.architectures.UnsupportedModelError` (a ValueError) for a model the engine would
    run wrong, before any actor starts."""
    from actors.loader import checked_config

    hf = checked_config(
        resolved_model or engine.model,
        engine.trust_remote_code,
        engine.tensor_parallel_size,
        engine.pipeline_parallel_size,
    ).get_text_config()
    context = engine.max_model_len or int(getattr(hf, "max_position_embeddings", None) or 2048)
    return context, int(hf.vocab_size)


def _plan_stage(  # noqa: ANN202
    config: ProcessorConfig, carry: tuple[str, ...], collector: Any, spread: ShardSpread | None
):
    from pipeline.stages.plan import PlanStage

    return PlanStage(config.plan, config.sampling, carry, collector, spread)
