"""raypack inside a user's own Ray Data program: `build_processor(config)(ds)`.

    ds -> intake (a key per row; the input columns set aside, unchanged) -> prompt tokens
       (the job's TokenizeStage, or TokenIdsStage for token-id prompts)
       -> shuffle by prefix key -> plan (the job's PlanStage: prefix groups, shards)
       -> one shard per block -> engine actors (the job's InferStage and its continuous feed)
       -> outflow (the input columns back, plus the generated columns)

Every operator is Ray Data's own (`map_batches` with tasks or an actor pool, `repartition`),
so the result is a lazy, streaming `ray.data.Dataset` the program goes on with: filter it,
join it, write it to any sink. A row that cannot run comes out with `error` set; it never
stops the dataset.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace

from actors.config import EngineConfig, SamplingParams
from pipeline import stage
from pipeline.config import ComputeConfig, PlanConfig, PromptConfig
from pipeline.engine_actor import default_torch_threads, engine_actor_args, shards_in_flight
from pipeline.processor_stages import (
    GENERATED_COLUMNS,
    INPUT,
    LOGPROBS,
    IntakeStage,
    OutflowStage,
    ProcessorInferStage,
    TokenIdsStage,
)
from pipeline.prompts import SAMPLING_FIELDS
from pipeline.tokenize import TokenizeStage


@dataclass(frozen=True)
class ProcessorConfig:
    """What the processor does to each row, validated once at construction.

    The prompt comes from exactly one of: `prompt_column` (text), `prompt_template` (a
    `str.format` template over the row's columns, e.g. `"{document}\\n\\nQ: {query}"`),
    `messages_column` (chat messages, rendered by the model's chat template) or
    `token_ids_column` (a list of token ids, used as they are). `chat` renders a text prompt as
    one user message through the chat template, after `system_prompt` when given. Text
    prompts are tokenized as `tokenizer(text)` (the tokenizer's special tokens, e.g. BOS;
    `add_special_tokens=False` leaves them out), chats as `apply_chat_template(...,
    tokenize=True)` (actors/tokenization.py), text in messages that spells a special token as
    plain text unless `allow_special_tokens_in_messages`.

    Defaults: `engine` EngineConfig() (the embedded SmolLM2-135M-Instruct), `sampling`
    SamplingParams() (greedy, max_tokens 16; `logprobs=k` adds the `logprobs` column),
    `chat` False, `system_prompt` None, `id_column` None (when given it must exist; it is
    carried like any other column), `override_columns` () (no per-row sampling unless named:
    columns named like SamplingParams fields), `sampling_column` None (a dict or JSON of such
    fields per row), `concurrency` 1 (engine actors), `plan` PlanConfig() (prefix grouping on,
    nested groups, 64-token prefix keys, shards of at most 256 rows / 65536 prompt tokens, one
    shuffle partition per engine actor unless `plan.num_partitions`), `compute`
    ComputeConfig() (engine actors take a GPU each when the cluster has GPUs, else 0.5 CPU;
    one tokenizer actor; engine_retries 1; max_restarts 3; its `num_actors` is `concurrency`).
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt_column: str | None = None
    prompt_template: str | None = None
    messages_column: str | None = None
    token_ids_column: str | None = None
    chat: bool = False
    system_prompt: str | None = None
    add_special_tokens: bool = True
    allow_special_tokens_in_messages: bool = False
    id_column: str | None = None
    override_columns: tuple[str, ...] = ()
    sampling_column: str | None = None
    concurrency: int = 1
    plan: PlanConfig = field(default_factory=PlanConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "override_columns", tuple(self.override_columns))
        sources = {
            "prompt_column": self.prompt_column,
            "prompt_template": self.prompt_template,
            "messages_column": self.messages_column,
            "token_ids_column": self.token_ids_column,
        }
        given = [name for name, value in sources.items() if value]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of prompt_column, prompt_template, messages_column or "
                f"token_ids_column; got {given or 'none'}"
            )
        if self.token_ids_column and (self.chat or self.system_prompt):
            raise ValueError("chat / system_prompt apply to text prompts, not token_ids_column")
        if not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise ValueError(f"concurrency must be an integer >= 1, got {self.concurrency!r}")
        if self.compute.num_actors not in (1, self.concurrency):
            raise ValueError("set the number of engine actors with concurrency, not compute")
        if self.engine.world_size > 1:
            raise ValueError(
                "the processor runs single-process engines; tensor/pipeline-parallel engines "
                "(tensor_parallel_size x pipeline_parallel_size > 1) run through raypack generate"
            )
        unknown = [c for c in self.override_columns if c not in SAMPLING_FIELDS]
        if unknown:
            raise ValueError(
                f"override_columns {unknown} are not SamplingParams fields {list(SAMPLING_FIELDS)}"
            )
        for name in self.source_columns:
            if name == stage.ID:  # the stages key rows by `id`
                raise ValueError(
                    f"a prompt built from a column named {stage.ID!r} is not supported: "
                    "rename the column (ds.rename_columns)"
                )
        if self.prompt is not None:
            self.prompt  # noqa: B018 (a malformed template raises ValueError now)

    @property
    def prompt(self) -> PromptConfig | None:
        """The job's prompt config for text and chat prompts (None for token ids)."""
        if self.token_ids_column:
            return None
        return PromptConfig(
            prompt_column=self.prompt_column,
            template=self.prompt_template,
            messages_column=self.messages_column,
            chat=self.chat,
            system_prompt=self.system_prompt,
            add_special_tokens=self.add_special_tokens,
            allow_special_tokens_in_messages=self.allow_special_tokens_in_messages,
            override_columns=self.override_columns,
            sampling_column=self.sampling_column,
        )

    @property
    def source_columns(self) -> tuple[str, ...]:
        """The input columns the prompt and its sampling overrides are read from."""
        prompt = self.prompt
        columns = prompt.source_columns if prompt else (self.token_ids_column or "",)
        extra = (self.sampling_column,) if self.sampling_column else ()
        return tuple(dict.fromkeys((*columns, *self.override_columns, *extra)))

    @property
    def with_logprobs(self) -> bool:
        """Whether rows get a `logprobs` column (asked by default or per row)."""
        return self.sampling.logprobs is not None or "logprobs" in self.override_columns

    @property
    def compute_config(self) -> ComputeConfig:
        """`compute` with `concurrency` engine actors."""
        return replace(self.compute, num_actors=self.concurrency)


class Processor:
    """`processor(ds)` -> a lazy dataset: every input column once per row, unchanged, plus
    `generated_text`, `generated_token_ids`, `num_prompt_tokens`, `num_generated_tokens`,
    `finish_reason`, `error` (null on success) and `logprobs` when asked."""

    def __init__(self, config: ProcessorConfig):
        self.config = config
        self._model: tuple[int, int] | None = None

    def __call__(self, ds):  # noqa: ANN001, ANN204 (ray.data.Dataset in and out)
        import ray
        import ray.data

        if not ray.is_initialized():  # as Ray Data itself would on first use
            ray.init()
        config, compute = self.config, self.config.compute_config
        max_model_len, vocab_size = self.model_facts()
        outputs = (*GENERATED_COLUMNS, *((LOGPROBS,) if config.with_logprobs else ()))
        needed = {c: "the prompt source or a sampling override" for c in config.source_columns}
        if config.id_column:
            needed.setdefault(config.id_column, "the id column")
        _check_schema(ds, needed, outputs)
        ds = ds.map_batches(
            IntakeStage(needed, outputs, config.source_columns),
            batch_format="pyarrow",
            batch_size=None,
            num_cpus=compute.task_num_cpus,
        )
        tokenizer_cls, tokenizer_args = self._tokenizer(max_model_len, vocab_size)
        ds = ds.map_batches(
            tokenizer_cls,
            **tokenizer_args,
            batch_format="pyarrow",
            batch_size=256,
            compute=ray.data.ActorPoolStrategy(size=compute.num_tokenize_actors),
            num_cpus=compute.tokenize_num_cpus,
        )
        plan = config.plan
        if plan.prefix_grouping:
            # Rows that can share a prefix meet in one hash partition (the job's shuffle).
            partitions = plan.num_partitions or compute.num_actors
            ds = (
                ds.repartition(1)
                if partitions == 1
                else ds.repartition(partitions, keys=[stage.SHUFFLE_KEY])
            )
        ds = ds.map_batches(
            _plan_stage(plan, config.sampling),
            batch_format="pyarrow",
            batch_size=None,  # a whole partition: its groups are complete
            num_cpus=compute.task_num_cpus,
        )
        ds = ds.repartition(target_num_rows_per_block=1)  # one shard per engine task
        args = engine_actor_args(compute)
        with warnings.catch_warnings():
            # As pipeline/job.py: bounded actor restarts have no named parameter (2.60).
            warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
            in_flight = shards_in_flight(config.engine, plan)
            ds = ds.map_batches(
                ProcessorInferStage,
                fn_constructor_args=(config.engine, config.sampling),
                fn_constructor_kwargs=dict(
                    keep_columns=(INPUT,),
                    torch_threads=compute.torch_threads or default_torch_threads(compute, args),
                    engine_retries=compute.engine_retries,
                    with_logprobs=config.with_logprobs,
                ),
                batch_format="pyarrow",
                batch_size=1,
                compute=ray.data.ActorPoolStrategy(
                    size=compute.num_actors,
                    max_concurrent_calls_per_actor=in_flight,
                    max_tasks_in_flight_per_actor=in_flight,
                    enable_true_multi_threading=True,
                ),
                **args,
            )
        return ds.map_batches(
            OutflowStage(config.with_logprobs),
            batch_format="pyarrow",
            batch_size=None,
            num_cpus=compute.task_num_cpus,
        )

    def retry_errors(self, ds):  # noqa: ANN001, ANN201 (ray.data.Dataset in and out)
        """The processor's `--retry-errors`: `ds` is a dataset this processor returned (its
        rows possibly changed since, e.g. a fixed override column). Rows whose `error` is null
        pass through as they are, nothing redone; the others lose their generated columns and
        run again. Every row comes back once (in no particular order, as `union` gives)."""
        from ray.data.expressions import col

        outputs = [*GENERATED_COLUMNS, *((LOGPROBS,) if self.config.with_logprobs else ())]
        names = list(ds.schema().names)
        missing = [c for c in outputs if c not in names]
        if missing:
            raise ValueError(
                f"retry_errors takes a dataset this processor returned; it has no {missing} "
                f"columns. Its columns: {names}"
            )
        kept = ds.filter(expr=col(stage.ERROR).is_null())
        failed = ds.filter(expr=col(stage.ERROR).is_not_null()).drop_columns(outputs)
        return kept.union(self(failed))

    def model_facts(self) -> tuple[int, int]:
        """The model's context length and vocabulary size (read once, on the driver)."""
        if self._model is None:
            self._model = model_facts(self.config.engine)
        return self._model

    def _tokenizer(self, max_model_len: int, vocab_size: int) -> tuple:
        config = self.config
        if config.token_ids_column:
            return TokenIdsStage, dict(
                fn_constructor_args=(config.token_ids_column,),
                fn_constructor_kwargs=dict(
                    max_model_len=max_model_len,
                    vocab_size=vocab_size,
                    sampling=config.sampling,
                    keep_columns=(INPUT,),
                    override_columns=config.override_columns,
                    sampling_column=config.sampling_column,
                    key_block_size=config.plan.key_block_size,
                ),
            )
        return TokenizeStage, dict(
            fn_constructor_args=(config.prompt,),
            fn_constructor_kwargs=dict(
                model=config.engine.model,
                max_model_len=max_model_len,
                sampling=config.sampling,
                keep_columns=(INPUT,),
                override_columns=config.override_columns,
                key_block_size=config.plan.key_block_size,
                trust_remote_code=config.engine.trust_remote_code,
            ),
        )


def build_processor(config: ProcessorConfig) -> Processor:
    """The processor for `config`: call it on a `ray.data.Dataset` (see `Processor`)."""
    return Processor(config)


def model_facts(engine: EngineConfig) -> tuple[int, int]:
    """(context length, vocabulary size) of the engine's model: `max_model_len` when set,
    else the model config's `max_position_embeddings`; FileNotFoundError for no model."""
    from transformers import AutoConfig

    from actors.loader import EMBEDDED_NAME, ensure_embedded_converted, resolve

    if engine.model == EMBEDDED_NAME:
        ensure_embedded_converted()  # once here, not in every actor at the same time
    src = resolve(engine.model)
    hf = AutoConfig.from_pretrained(
        src.path, gguf_file=src.gguf_file, trust_remote_code=engine.trust_remote_code
    ).get_text_config()
    context = engine.max_model_len or int(getattr(hf, "max_position_embeddings", None) or 2048)
    return context, int(hf.vocab_size)


def _plan_stage(plan: PlanConfig, sampling: SamplingParams):  # noqa: ANN202 (PlanStage)
    from pipeline.plan import PlanStage

    return PlanStage(plan, sampling, (INPUT,))


def _check_schema(ds, needed: dict[str, str], outputs: tuple[str, ...]) -> None:  # noqa: ANN001
    """The intake's checks now, when the schema is known without running anything."""
    try:
        schema = ds.schema(fetch_if_missing=False)
    except Exception:  # noqa: BLE001 (no cheap schema: the intake checks the first batch)
        return
    if schema is None:
        return
    IntakeStage(needed, outputs, ()).check(list(schema.names))
