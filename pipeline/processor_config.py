"""`ProcessorConfig`: what the processor does to each row, the one config of the path from
keyed rows to the engine's rows that the processor and the offline job share
(pipeline/processor.py). Nothing here touches Ray, the filesystem or the model."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pyarrow as pa

from actors.config import EngineConfig, SamplingParams
from pipeline import stage
from pipeline.config import ComputeConfig, PlanConfig, PromptConfig
from pipeline.parsed import PARSED, parsed_type
from pipeline.prompts import SAMPLING_FIELDS


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
    fields per row), `text_column` "generated_text" (the generated text's column),
    `concurrency` 1 (engine actors), `plan` PlanConfig() (prefix grouping on, nested groups,
    64-token prefix keys, shards of at most 256 rows / 65536 prompt tokens, one shuffle
    partition per engine actor unless `plan.num_partitions`), `compute` ComputeConfig()
    (engine actors take a GPU each when the cluster has GPUs, else 0.5 CPU; one tokenizer
    actor; engine_retries 1; max_restarts 3; its `num_actors` is `concurrency`).

    Tensor/pipeline-parallel engines (tp x pp > 1) need a placement group per engine actor,
    reserved for the run: the offline job reserves them and hands them to
    `Processor.engine_rows`; `processor(ds)` refuses such an engine.
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
    text_column: str = "generated_text"
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
        if not self.text_column:
            raise ValueError("text_column is empty")
        unknown = [c for c in self.override_columns if c not in SAMPLING_FIELDS]
        if unknown:
            raise ValueError(
                f"override_columns {unknown} are not SamplingParams fields {list(SAMPLING_FIELDS)}"
            )
        if self.prompt is not None:
            self.prompt  # noqa: B018 (a malformed template raises ValueError now)

    @classmethod
    def of_prompt(cls, prompt: PromptConfig, **kwargs) -> ProcessorConfig:  # noqa: ANN003
        """The config whose text or chat prompt is `prompt` (the offline job's), with the
        other fields from `kwargs`."""
        return cls(
            prompt_column=prompt.prompt_column,
            prompt_template=prompt.template,
            messages_column=prompt.messages_column,
            chat=prompt.chat,
            system_prompt=prompt.system_prompt,
            add_special_tokens=prompt.add_special_tokens,
            allow_special_tokens_in_messages=prompt.allow_special_tokens_in_messages,
            override_columns=prompt.override_columns,
            sampling_column=prompt.sampling_column,
            **kwargs,
        )

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
        return self.sampling.logprobs is not None or stage.LOGPROBS in self.override_columns

    @property
    def output_columns(self) -> tuple[str, ...]:
        """What the processor adds to every row, in this order: the text column,
        `generated_token_ids`, `num_prompt_tokens`, `num_generated_tokens`, `finish_reason`,
        `error`, `logprobs` when asked, and `parsed` when guided by JSON."""
        return (
            self.text_column,
            stage.GENERATED_TOKEN_IDS,
            stage.NUM_PROMPT_TOKENS,
            stage.NUM_GENERATED_TOKENS,
            stage.FINISH_REASON,
            stage.ERROR,
            *((stage.LOGPROBS,) if self.with_logprobs else ()),
            *((PARSED,) if self.parsed_type is not None else ()),
        )

    @property
    def parsed_type(self) -> pa.DataType | None:
        """The `parsed` column's type when rows get one (JSON-guided: pipeline/parsed.py)."""
        return parsed_type(self.sampling, self.override_columns)

    @property
    def compute_config(self) -> ComputeConfig:
        """`compute` with `concurrency` engine actors."""
        return replace(self.compute, num_actors=self.concurrency)

    @property
    def num_partitions(self) -> int:
        """Hash partitions of the shuffle by prefix key: `plan.num_partitions`, else one per
        engine actor."""
        return self.plan.num_partitions or self.concurrency
