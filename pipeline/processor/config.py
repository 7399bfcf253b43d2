"""`ProcessorConfig`: what the processor does to each row, the one config of the path from
keyed rows to the engine's rows that the processor and the offline job share
(pipeline/processor/build.py). Nothing here touches Ray, the filesystem or the model."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa

from actors.config import EngineConfig, SamplingParams
from pipeline.config import ComputeConfig, PlanConfig, PromptConfig
from pipeline.stages import stage
from pipeline.stages.parsed import PARSED, parsed_type
from pipeline.stages.prompts import SAMPLING_FIELDS


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
    plain text unless `allow_special_tokens_in_messages`; `chat_template` (a template's
    text) replaces the tokenizer's and `chat_template_kwargs` reach the template (vLLM's
    names, e.g. `{"enable_thinking": False}` for Qwen3).

    Defaults: `engine` EngineConfig() (the embedded SmolLM2-135M-Instruct), `sampling`
    SamplingParams() (greedy, max_tokens 16; `logprobs=k` adds the `logprobs` column),
    `chat` False, `system_prompt` None, `id_column` None (when given it must exist; it is
    carried like any other column), `override_columns` () (no per-row sampling unless named:
    columns named like SamplingParams fields), `sampling_column` None (a dict or JSON of such
    fields per row), `text_column` "generated_text" (the generated text's column),
    `concurrency` 1 (engine actors: a number, or `(min, max)` for an actor pool Ray Data
    grows and shrinks between the two, as in Ray Data LLM), `plan` PlanConfig() (prefix grouping on, nested groups,
    64-token prefix keys, shards of at most 256 rows / 65536 prompt tokens, one shuffle
    partition per engine actor unless `plan.num_partitions`), `compute` ComputeConfig()
    (engine actors take a GPU each when the cluster has GPUs, else 0.5 CPU; one tokenizer
    actor; engine_retries 1; max_restarts 3; its `num_actors` is `concurrency`; its
    `engines_per_actor` 1 unless given: `ComputeConfig(engines_per_actor=2)` runs two CPU
    engines in each actor, each on its own thread, as the job does on a single node).

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
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    id_column: str | None = None
    override_columns: tuple[str, ...] = ()
    sampling_column: str | None = None
    text_column: str = "generated_text"
    concurrency: int | tuple[int, int] = 1
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
        if self.token_ids_column and (self.chat or self.system_prompt or self.chat_template):
            raise ValueError("chat / system_prompt apply to text prompts, not token_ids_column")
        low, high = self.actor_pool_size
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high)) or not (
            1 <= low <= high
        ):
            raise ValueError(
                f"concurrency must be an integer >= 1 or a (min, max) pair of them with min <= "
                f"max, got {self.concurrency!r}"
            )
        if self.compute.num_actors not in (1, "auto", high):
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
            chat_template=prompt.chat_template,
            chat_template_kwargs=prompt.chat_template_kwargs,
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
            chat_template=self.chat_template,
            chat_template_kwargs=self.chat_template_kwargs,
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
    def with_samples(self) -> bool:
        """Whether rows get a `sample_index` column: a row can have several samples (`n` > 1
        by default, or `n` / `best_of` per row: an override column or the sampling column);
        each sample is an output row of its own with the row's columns."""
        per_row = {"n", "best_of"} & set(self.override_columns) or self.sampling_column
        return self.sampling.num_samples > 1 or bool(per_row)

    @property
    def output_columns(self) -> tuple[str, ...]:
        """What the processor adds to every row, in this order: the text column,
        `generated_token_ids`, `num_prompt_tokens`, `num_generated_tokens`, `finish_reason`,
        `error`, `logprobs` when asked, `sample_index` when a row can have several
        samples, and `parsed` when guided by JSON."""
        return (
            self.text_column,
            stage.GENERATED_TOKEN_IDS,
            stage.NUM_PROMPT_TOKENS,
            stage.NUM_GENERATED_TOKENS,
            stage.FINISH_REASON,
            stage.ERROR,
            *((stage.LOGPROBS,) if self.with_logprobs else ()),
            *((stage.SAMPLE_INDEX,) if self.with_samples else ()),
            *((PARSED,) if self.parsed_type is not None else ()),
        )

    @property
    def parsed_type(self) -> pa.DataType | None:
        """The `parsed` column's type when rows get one (JSON-guided: pipeline/stages/parsed.py)."""
        return parsed_type(self.sampling, self.override_columns)

    @property
    def actor_pool_size(self) -> tuple[int, int]:
        """The engine actors at least and at most (`concurrency` as a pair)."""
        if isinstance(self.concurrency, tuple | list) and len(self.concurrency) == 2:
            return self.concurrency[0], self.concurrency[1]
        return self.concurrency, self.concurrency  # type: ignore[return-value]

    @property
    def compute_config(self) -> ComputeConfig:
        """`compute` with the most engine actors `concurrency` allows."""
        return replace(self.compute, num_actors=self.actor_pool_size[1])

    @property
    def num_partitions(self) -> int:
        """Hash partitions of the shuffle by prefix key: `plan.num_partitions`, else one per
        engine actor (at most)."""
        return self.plan.num_partitions or self.actor_pool_size[1]
