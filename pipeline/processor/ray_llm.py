"""Ray Data LLM's call shape over raypack's processor, so a `ray.data.llm` program runs after
changing only its import and its config class (docs/ray-data-llm.md):

    from pipeline.processor.build import LLMProcessorConfig, build_processor
    config = LLMProcessorConfig(model_source=..., engine_kwargs={...}, concurrency=(1, 2))
    processor = build_processor(config, preprocess=fn, postprocess=fn)

`LLMProcessorConfig` takes the fields of Ray's `vLLMEngineProcessorConfig` that mean something
here. The rows the preprocess returns carry `messages` (chat, `apply_chat_template=True`, the
default) or `prompt` (text), and `sampling_params` (a dict of vLLM sampling fields, optional);
every column they have travels to the postprocess, which also gets Ray's output columns:
`prompt` (for chat rows: the chat template's text, as Ray's chat template stage adds it),
`generated_text` (unless `detokenize=False`), `generated_tokens`, `num_generated_tokens`,
`num_input_tokens`, and ours: `finish_reason`, `error` (a row that cannot run gets it, it never
stops the dataset), `sample_index` (0, or 0..n-1 for a row whose sampling_params ask `n`
samples: a row each).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from actors.config import EngineConfig
from pipeline.processor.config import ProcessorConfig
from pipeline.stages import stage
from pipeline.stages.prompts import PromptBuilder, RowError
from pipeline.stages.stage import Stage

logger = logging.getLogger(__name__)

MESSAGES = "messages"  # Ray Data LLM's chat column
PROMPT = "prompt"  # its text prompt column
SAMPLING_PARAMS = "sampling_params"  # its per-row sampling column
# Ray Data LLM's names of our output columns.
RAY_NAMES = {
    stage.GENERATED_TOKEN_IDS: "generated_tokens",
    stage.NUM_PROMPT_TOKENS: "num_input_tokens",
}
_DTYPES = {
    "auto": "auto",
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}
# vLLM engine arguments with no counterpart here that change no output, so a ported program
# keeps running: accepted, and named in a warning. Any other unknown argument is an error.
_NO_EFFECT = {
    "enable_chunked_prefill": "prefill is always chunked under the step budget",
    "gpu_memory_utilization": "the KV cache is sized by kv_cache_memory_gb",
    "enforce_eager": "there are no CUDA graphs to turn off",
    "disable_log_stats": "the engine logs one summary line per 100 steps",
}


def engine_config(model: str, engine_kwargs: Mapping[str, Any] | None) -> EngineConfig:
    """vLLM-style `engine_kwargs` as an `EngineConfig`: vLLM's names where they are ours
    (`max_model_len`, `max_num_batched_tokens`, `max_num_seqs`, `block_size`,
    `enable_prefix_caching`, `tensor_parallel_size`, `pipeline_parallel_size`, `seed`,
    `trust_remote_code`, `dtype` with vLLM's values), any other EngineConfig field by its
    name, and `_NO_EFFECT`'s arguments ignored with a warning; ValueError naming unknown
    keys and listing the known ones."""
    kwargs = dict(engine_kwargs or {})
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    unknown = sorted(k for k in kwargs if k not in fields and k not in _NO_EFFECT)
    if unknown:
        raise ValueError(
            f"engine_kwargs {unknown} are not engine settings here; known: "
            f"{sorted(fields | set(_NO_EFFECT))}"
        )
    for name in sorted(set(kwargs) & set(_NO_EFFECT)):
        logger.warning(
            "engine_kwargs %s=%r has no effect: %s", name, kwargs[name], _NO_EFFECT[name]
        )
        del kwargs[name]
    if "dtype" in kwargs:
        dtype = kwargs["dtype"]
        if dtype not in _DTYPES:
            raise ValueError(f"engine_kwargs dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        kwargs["dtype"] = _DTYPES[dtype]
    return EngineConfig(model=model, **kwargs)


@dataclass(frozen=True)
class LLMProcessorConfig:
    """Ray Data LLM's `vLLMEngineProcessorConfig`, for raypack's processor.

    `model_source`: the model (a local folder, a `.gguf`, a storage URI, or `smollm2`);
    `engine_kwargs`: vLLM engine arguments (`engine_config`); `concurrency`: engine actors, a
    number or `(min, max)`; `batch_size`: accepted for compatibility (the processor plans
    its own shards by shared prefix); `apply_chat_template`: rows carry `messages` (True) or
    `prompt` text (False); `chat_template` / `chat_template_kwargs`: the template's text and
    variables (vLLM's names); `tokenize`: accepted, tokens are always made by one tokenizer
    stage as Hugging Face makes them; `detokenize=False` leaves `generated_text` out;
    `has_image` must stay False (text models only).
    """

    model_source: str
    engine_kwargs: dict[str, Any] | None = None
    concurrency: int | tuple[int, int] = 1
    batch_size: int = 32
    apply_chat_template: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tokenize: bool = True
    detokenize: bool = True
    has_image: bool = False

    def __post_init__(self) -> None:
        if self.has_image:
            raise ValueError("has_image=True is not supported: raypack runs text models")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        if isinstance(self.concurrency, list):
            object.__setattr__(self, "concurrency", tuple(self.concurrency))
        self.processor_config()  # every other check, now

    def processor_config(self) -> ProcessorConfig:
        """The raypack processor's config for the rows the preprocess returns."""
        chat = self.apply_chat_template
        return ProcessorConfig(
            engine=engine_config(self.model_source, self.engine_kwargs),
            messages_column=MESSAGES if chat else None,
            prompt_column=None if chat else PROMPT,
            chat_template=self.chat_template,
            chat_template_kwargs=self.chat_template_kwargs,
            sampling_column=SAMPLING_PARAMS,
            concurrency=self.concurrency,
        )

    def output_columns(self, columns: tuple[str, ...]) -> tuple[str, ...]:
        """The processor's output columns under Ray Data LLM's names (`RayColumnsStage`)."""
        out = [RAY_NAMES.get(c, c) for c in columns]
        return tuple(c for c in out if self.detokenize or c != "generated_text")


class ChatPromptStage(Stage):
    """Chat rows -> the same rows with `prompt`, the chat template's text of their `messages`
    (null when the template rejects them: the tokenizer stage gives that row its error), as
    Ray Data LLM's chat template stage leaves it for the postprocess. A plain callable (Ray
    Data tasks): the tokenizer is loaded once per task."""

    name = "ray.data.llm chat prompt"

    def __init__(self, config: ProcessorConfig):
        assert config.prompt is not None and config.messages_column, "chat configs only"
        self.prompt = config.prompt
        self.model = config.engine.model
        self.trust_remote_code = config.engine.trust_remote_code

    def required_columns(self) -> tuple[str, ...]:
        return (MESSAGES,)

    def process(self, batch: pa.Table) -> pa.Table:
        from actors.loader import load_tokenizer

        builder = PromptBuilder(self.prompt, load_tokenizer(self.model, self.trust_remote_code))
        texts: list[str | None] = []
        for messages in batch.column(MESSAGES).to_pylist():
            try:
                texts.append(builder.build({MESSAGES: messages}))
            except RowError:
                texts.append(None)
        column = pa.array(texts, pa.string())
        if PROMPT in batch.column_names:
            return batch.set_column(batch.column_names.index(PROMPT), PROMPT, column)
        return batch.append_column(PROMPT, column)


class RayColumnsStage(Stage):
    """The processor's rows -> Ray Data LLM's column names (`RAY_NAMES`), without
    `generated_text` when the config does not detokenize."""

    name = "ray.data.llm columns"

    def __init__(self, detokenize: bool = True):
        self.detokenize = detokenize

    def required_columns(self) -> tuple[str, ...]:
        return tuple(RAY_NAMES)

    def process(self, batch: pa.Table) -> pa.Table:
        names = [RAY_NAMES.get(c, c) for c in batch.column_names]
        table = batch.rename_columns(names)
        if not self.detokenize and "generated_text" in names:
            table = table.drop_columns(["generated_text"])
        return table
