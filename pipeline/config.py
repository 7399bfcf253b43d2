"""Typed configuration of the offline job: frozen dataclasses, validated once at construction.

The CLI (`pipeline/commands/cli.py`) builds these from flags; the stages receive only the parts they
need. Nothing here touches Ray, the filesystem or the model.
"""

from __future__ import annotations

import dataclasses
import json
import string
from dataclasses import dataclass, field
from typing import Any, Literal

from actors.allocator import check_allocator
from actors.config import EngineConfig, SamplingParams
from packing.prefix import MIN_SHARED_TOKENS
from pipeline.stages import columns

InputFormat = Literal["parquet", "jsonl", "csv", "hf"]
_FORMATS = ("parquet", "jsonl", "csv", "hf")
OUTPUT_ID = "id"  # the output's id column (the user's id column is copied into it as text)


@dataclass(frozen=True)
class InputConfig:
    """Where the prompt table is and which of its columns matter.

    `path` is a file, a folder or a glob; `format` None means "from the file names" (a folder
    saved by `datasets.save_to_disk` is `hf`). Without `id_column` each row's id is a hash of
    its content, so identical rows share an id and are generated once.
    """

    path: str
    format: InputFormat | None = None
    id_column: str | None = None
    keep_columns: tuple[str, ...] = ()
    hf_split: str | None = None  # for a saved DatasetDict: which split to read

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("input path is empty")
        if self.format is not None and self.format not in _FORMATS:
            raise ValueError(f"input format must be one of {_FORMATS}, got {self.format!r}")
        object.__setattr__(self, "keep_columns", tuple(dict.fromkeys(self.keep_columns)))
        columns.check_written("--keep-columns", self.keep_columns)
        if self.id_column is not None:
            columns.check_read("--id-column", [self.id_column], None)


@dataclass(frozen=True)
class PromptConfig:
    """How a row becomes a prompt: exactly one of a text column, a template, a messages column.

    `template` is `str.format` syntax over column names (`"{document}\\n\\nQ: {query}"`).
    `messages_column` holds chat messages (a list of {"role", "content"}, or that as JSON),
    always rendered with the tokenizer's chat template; `chat` renders a text prompt as one
    user message (after `system_prompt`, when given) the same way. Token ids are as Hugging
    Face makes them (actors/tokenization.py): `tokenizer(text)` for a text prompt,
    `apply_chat_template(messages, add_generation_prompt=True, tokenize=True)` for a chat.

    Per-row sampling overrides come only from the columns named in `override_columns`
    (each named like a SamplingParams field: `--sampling-columns temperature,max_tokens`; a
    column that merely has such a name is not used) and from `sampling_column` (a dict, or
    JSON text, of SamplingParams fields per row).

    `chat_template` (a Jinja template's text) replaces the tokenizer's chat template and
    `chat_template_kwargs` (e.g. `{"enable_thinking": false}` for Qwen3) are passed to it, as
    `apply_chat_template(..., chat_template=..., **chat_template_kwargs)` takes them (vLLM's
    names); both only for chat prompts.
    """

    prompt_column: str | None = None
    template: str | None = None
    messages_column: str | None = None
    chat: bool = False
    system_prompt: str | None = None
    # A text prompt gets the tokenizer's special tokens (BOS...) as `tokenizer(text)` adds them;
    # False leaves them out (vLLM's option). Chat prompts get none on top of the template's.
    add_special_tokens: bool = True
    # Text inside chat messages that spells a special token (`<|im_end|>`) is tokenized as
    # plain text, so a row cannot forge a turn; True tokenizes it as the token (HF's default).
    allow_special_tokens_in_messages: bool = False
    override_columns: tuple[str, ...] = ()
    sampling_column: str | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        check_chat_template(self.chat_template, self.chat_template_kwargs)
        if (self.chat_template or self.chat_template_kwargs) and not self.uses_chat_template:
            raise ValueError(
                "chat_template / chat_template_kwargs apply to chat prompts: set chat or "
                "messages_column"
            )
        given = [
            name
            for name, value in (
                ("prompt_column", self.prompt_column),
                ("template", self.template),
                ("messages_column", self.messages_column),
            )
            if value
        ]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of prompt_column, template or messages_column; "
                f"got {given or 'none'}"
            )
        object.__setattr__(self, "override_columns", tuple(self.override_columns))
        fields = {f.name for f in dataclasses.fields(SamplingParams)}
        unknown = [c for c in self.override_columns if c not in fields]
        if unknown:
            raise ValueError(
                f"sampling columns {unknown} are not SamplingParams fields {sorted(fields)}"
            )
        if self.template is not None:
            self.template_fields  # noqa: B018 (raises ValueError on a malformed template)

    @property
    def template_fields(self) -> tuple[str, ...]:
        """The column names a template refers to, in order of first use, the fields inside a
        field's format spec too (`{prompt:>{width}}` uses `width`)."""
        if self.template is None:
            return ()
        names: list[str] = []
        try:
            _template_fields(self.template, names, depth=0)
        except ValueError as exc:
            raise ValueError(f"--template {self.template!r} is malformed: {exc}") from None
        return tuple(names)

    @property
    def source_columns(self) -> tuple[str, ...]:
        """The input columns the prompt is built from."""
        if self.prompt_column:
            return (self.prompt_column,)
        if self.messages_column:
            return (self.messages_column,)
        return self.template_fields

    @property
    def uses_chat_template(self) -> bool:
        """True when the prompt text comes out of the tokenizer's chat template."""
        return self.chat or self.messages_column is not None


def check_chat_template(template: object, kwargs: object) -> None:
    """ValueError unless `template` is None or non-empty text and `kwargs` None or a JSON
    object (names to JSON values): what a job's lineage can record."""
    if template is not None and (not isinstance(template, str) or not template.strip()):
        raise ValueError(f"chat_template must be a template's text, got {str(template)[:80]!r}")
    if kwargs is None:
        return
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"chat_template_kwargs must map names to values, got {kwargs!r}"[:200])
    try:
        json.dumps(kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"chat_template_kwargs must be JSON values: {exc}") from None


def _template_fields(template: str, names: list[str], depth: int) -> None:
    """Add the fields of `template` (and of its fields' format specs) to `names`; ValueError
    on a field that is no column name, an unknown conversion or specs nested too deep (as
    `str.format`, one level)."""
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if not name or not name.isidentifier():
            raise ValueError(
                f"template fields must be column names like {{document}}, got {{{name}}}"
            )
        if conversion not in (None, "r", "s", "a"):
            raise ValueError(f"field {{{name}!{conversion}}}: the conversion must be !r, !s or !a")
        if name not in names:
            names.append(name)
        if spec and "{" in spec:
            if depth > 0:
                raise ValueError(f"field {{{name}}}: format specs nest one level at most")
            _template_fields(spec, names, depth + 1)


@dataclass(frozen=True)
class PlanConfig:
    """How rows become prefix groups and shards for the engine actors.

    A shard is what one engine call gets: whole prefix groups up to `max_rows_per_shard` rows
    and `max_tokens_per_shard` prompt tokens (a shared prefix counted once). A single group
    larger than that is split, its prefix repeated in each part. `prefix_grouping=False`
    skips the shuffle and the grouping (every row alone), for comparison.

    With `nested`, the engine gets every shared prefix inside a shard as nested groups
    (`packing.prefix_forest`: a common opening once, then each document once, ...) rather
    than only the first-level groups; prefixes shorter than `nested_min_shared` tokens are
    not worth a group of their own.
    """

    prefix_grouping: bool = True
    nested: bool = True
    nested_min_shared: int = MIN_SHARED_TOKENS
    key_block_size: int = 64  # tokens hashed into the prefix key (rows shorter have none)
    max_rows_per_shard: int = 256
    max_tokens_per_shard: int = 65536
    # Hash partitions of the shuffle. None: one per engine actor (the processor), or for the
    # job one per 64 MiB of input (pipeline/job/run.py `partitions_for`).
    num_partitions: int | None = None
    # rows sharing an id with different content: see pipeline/stages/dedupe.py
    on_duplicate: str = "error"

    def __post_init__(self) -> None:
        if self.on_duplicate not in ("error", "first"):
            raise ValueError(f"on_duplicate must be 'error' or 'first', got {self.on_duplicate!r}")
        for name in (
            "key_block_size",
            "max_rows_per_shard",
            "max_tokens_per_shard",
            "nested_min_shared",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_partitions is not None and self.num_partitions < 1:
            raise ValueError(f"num_partitions must be >= 1, got {self.num_partitions}")


DEFAULT_CPUS_PER_ACTOR = 0.5  # an engine actor's CPUs for Ray's scheduling, when not set
AUTO_ACTORS = "auto"  # `num_actors` counted per job (pipeline/job/engine_count.py)


@dataclass(frozen=True)
class ComputeConfig:
    """Where the stages run.

    `num_actors="auto"` (the default) counts the job's engine actors: on CPU nodes as many
    engines of `torch_threads` (1 when unset) threads as the CPUs and memory hold, where the
    rows are enough to pay for their start; one for GPU, tp x pp or custom-resource engines
    (pipeline/job/engine_count.py). Engine actors take one GPU each when `num_gpus_per_actor`
    is None and the cluster has GPUs; on CPU they take `num_cpus_per_actor` (None: 0.5, less
    for auto-counted engines that would otherwise leave no node a whole CPU; fractional: on a
    2-core machine two whole-CPU actors leave nothing for the read tasks and Ray Data waits
    forever). `resources`
    adds custom resources per engine actor (tests use {"fake_gpu": 1}); `memory_gb_per_actor`
    asks Ray for that much memory per engine actor, which keeps engines off small nodes.

    A tensor/pipeline-parallel engine (EngineConfig tp x pp > 1) gets a placement group of
    tp x pp bundles per engine actor, one per worker (a GPU each on a GPU cluster, else
    `EngineConfig.worker_num_cpus` CPUs); the engine actor sits in bundle 0 with its own CPUs,
    custom resources and memory. A shard whose worker dies mid-step is redone on a fresh
    engine (new workers) up to `engine_retries` times; after that the job fails with the cause.

    `engines_per_actor` engines run in each engine actor, each stepped by a thread of its own
    on `torch_threads` threads (pipeline/stages/infer.py): "auto" (the default) pairs a job's
    auto-counted CPU engines on a single node, else 1 (pipeline/job/engine_count.py).
    Two 1-thread engines as threads of one process stepped as fast as in two processes (2-core
    Zen 4, 2 x 128 Alpaca rows: 30.6 and 29.6 s against 30.4 and 31.6 s), and the process
    pays its start once: torch, transformers and Ray Data imported once, not per engine.
    """

    num_actors: int | str = AUTO_ACTORS
    engines_per_actor: int | str = AUTO_ACTORS
    num_gpus_per_actor: float | None = None
    num_cpus_per_actor: float | None = None
    resources: tuple[tuple[str, float], ...] = ()
    torch_threads: int | None = None  # None: torch's default in the actor
    num_tokenize_actors: int = 1
    tokenize_num_cpus: float = 0.25
    task_num_cpus: float = 0.25  # read, id and plan tasks
    max_restarts: int = 3  # per engine actor; its unfinished shard is retried as often
    memory_gb_per_actor: float | None = None  # Ray `memory` per engine actor; None: no request
    engine_retries: int = 1  # fresh engines per shard after a tp/pp worker failure
    placement_timeout_s: float = 600.0  # wait for the tp x pp engines' placement groups
    # An autoscaling cluster's nodes come when asked: skip the checks against the nodes up now
    # (groups they can never hold, CPU room) and wait placement_timeout_s for the groups.
    wait_for_nodes: bool = False
    rows_per_block: int = 1024  # read blocks are cut to this so the tokenizers share the work
    # The engine actors' malloc (actors/allocator.py): tcmalloc when the machine has it.
    allocator: str = "auto"

    def __post_init__(self) -> None:
        if self.num_actors != AUTO_ACTORS and (
            not isinstance(self.num_actors, int) or self.num_actors < 1
        ):
            raise ValueError(
                f"num_actors must be an integer >= 1 or 'auto', got {self.num_actors!r}"
            )
        if self.engines_per_actor != AUTO_ACTORS and (
            not isinstance(self.engines_per_actor, int) or self.engines_per_actor < 1
        ):
            raise ValueError(
                "engines_per_actor must be an integer >= 1 or 'auto', got "
                f"{self.engines_per_actor!r}"
            )
        if self.num_cpus_per_actor is not None and self.num_cpus_per_actor < 0:
            raise ValueError(f"num_cpus_per_actor must be >= 0, got {self.num_cpus_per_actor}")
        if self.num_tokenize_actors < 1:
            raise ValueError(f"num_tokenize_actors must be >= 1, got {self.num_tokenize_actors}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.placement_timeout_s <= 0:
            raise ValueError(f"placement_timeout_s must be > 0, got {self.placement_timeout_s}")
        if not isinstance(self.engine_retries, int) or self.engine_retries < 0:
            raise ValueError(f"engine_retries must be an integer >= 0, got {self.engine_retries!r}")
        if self.memory_gb_per_actor is not None and self.memory_gb_per_actor <= 0:
            raise ValueError(f"memory_gb_per_actor must be > 0, got {self.memory_gb_per_actor}")
        if self.rows_per_block < 1:
            raise ValueError(f"rows_per_block must be >= 1, got {self.rows_per_block}")
        check_allocator(self.allocator)
        object.__setattr__(self, "resources", tuple((str(k), float(v)) for k, v in self.resources))

    @property
    def actor_cpus(self) -> float:
        """An engine actor's CPUs for Ray's scheduling: `num_cpus_per_actor`, else 0.5."""
        return (
            DEFAULT_CPUS_PER_ACTOR if self.num_cpus_per_actor is None else self.num_cpus_per_actor
        )

    @property
    def engines_each(self) -> int:
        """The engines one actor runs: `engines_per_actor`, "auto" still unresolved being 1."""
        return 1 if self.engines_per_actor == AUTO_ACTORS else int(self.engines_per_actor)

    @property
    def num_engines(self) -> int:
        """The engines over all the engine actors (`num_actors` counted: not "auto")."""
        return int(self.num_actors) * self.engines_each


@dataclass(frozen=True)
class FilesConfig:
    """How the output is cut into Parquet files (pipeline/io/writer.py).

    A file is closed (and only then visible under its name) at `max_rows_per_file` rows or at
    about `max_bytes_per_file` bytes, whichever comes first: Ray Data's own defaults for its
    file writes are of this order (128 MiB blocks, `max_rows_per_file`). Each of `num_writers`
    writer actors (None: one per 8 engines, `pipeline.io.writer.default_num_writers`)
    keeps one file open, so a job ends with about rows / max_rows_per_file files plus one per
    writer.
    """

    max_rows_per_file: int = 1_000_000
    max_bytes_per_file: int = 128 * 2**20
    num_writers: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_rows_per_file", "max_bytes_per_file"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_writers is not None and (
            not isinstance(self.num_writers, int) or self.num_writers < 1
        ):
            raise ValueError(f"num_writers must be an integer >= 1, got {self.num_writers!r}")


@dataclass(frozen=True)
class JobConfig:
    """The whole offline job: input, prompt, engine, default sampling, plan, compute, output
    (and its files' sizes).

    `overwrite` starts the output folder over (its earlier run's files deleted) instead of
    refusing a folder another lineage produced (pipeline/io/lineage.py); `retry_errors` generates
    again the rows whose stored output has an error, replacing them (pipeline/io/resume.py).
    """

    input: InputConfig
    prompt: PromptConfig
    output: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    plan: PlanConfig = field(default_factory=PlanConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    files: FilesConfig = field(default_factory=FilesConfig)
    text_column: str = "generated_text"
    overwrite: bool = False
    retry_errors: bool = False

    def __post_init__(self) -> None:
        if not self.output:
            raise ValueError("output path is empty")
        if not self.text_column:
            raise ValueError("--text-column is empty")
        columns.check_written("--text-column", [self.text_column])
        columns.check_written("--keep-columns", self.input.keep_columns, self.text_column)
        prompt, id_column = self.prompt, self.input.id_column
        for flag, names in (
            ("--prompt-column", [prompt.prompt_column]),
            ("--messages-column", [prompt.messages_column]),
            ("--template", prompt.template_fields),
            ("--sampling-columns", prompt.override_columns),
            ("--sampling-column", [prompt.sampling_column]),
        ):
            columns.check_read(flag, [n for n in names if n], id_column)
        if self.engine.world_size > 1 and self.compute.num_gpus_per_actor:
            raise ValueError(
                "with tensor/pipeline parallel engines each worker takes one GPU in the engine's "
                "placement group; num_gpus_per_actor applies to single-process engines only"
            )
