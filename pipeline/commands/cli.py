"""Command-line pieces shared by `raypack generate` and `raypack snippets`: flags -> JobConfig,
Ray connection, and the run with a readable failure for bad input.

Every flag's default is read from the dataclass it sets (`SamplingParams`, `PlanConfig`,
`ComputeConfig`, `EngineConfig` via pipeline/engine_flags.py), so a default lives in one place
and `--help` shows it."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import replace

from actors.allocator import ALLOCATORS
from actors.config import SamplingParams
from pipeline.commands import console
from pipeline.commands.console import ConsoleOptions
from pipeline.commands.guided_flags import add_guided_args, guided_from_args
from pipeline.commands.shutdown import shutdown_ray
from pipeline.config import (
    AUTO_ACTORS,
    ComputeConfig,
    FilesConfig,
    InputConfig,
    JobConfig,
    PlanConfig,
    PromptConfig,
)
from pipeline.engine_flags import add_engine_flags, engine_config_from_args
from pipeline.job.engine_placement import NoRoomError
from pipeline.job.phases import JobClock

logger = logging.getLogger(__name__)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with each option's default ("none" for an unset one), except for switches and
    required options, or where the help text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            action.required
            or not action.option_strings
            or action.nargs == 0  # a switch (store_true) or --help
            or "default" in text
        ):
            return text
        shown = "none" if action.default is None else "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


def add_io_args(parser: argparse.ArgumentParser) -> None:
    """--input, --output and the input's shape."""
    g = parser.add_argument_group("input and output")
    g.add_argument(
        "--input",
        required=True,
        help="Parquet/JSONL/CSV file, folder or glob, local or a URI (s3://, gs://), or a local "
        "datasets.save_to_disk folder",
    )
    g.add_argument(
        "--output",
        required=True,
        help="output folder (Parquet), local or a URI (s3://, gs://); a rerun resumes it "
        "when its lineage (_lineage.json: model, tokenizer, prompt, sampling, version) is the "
        "same, else exits 2 naming what differs",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="start --output over: delete the earlier run's files (never others) and record "
        "this job's lineage",
    )
    g.add_argument(
        "--retry-errors",
        action="store_true",
        help="on a rerun, generate again the rows whose stored output has an error, replacing "
        "them (nothing else is redone)",
    )

    files = FilesConfig()
    g.add_argument(
        "--max-rows-per-file",
        type=int,
        default=files.max_rows_per_file,
        help="rows per output file at most (whole shards: a shard larger than this gets a "
        "file of its own)",
    )
    g.add_argument(
        "--max-bytes-per-file",
        type=int,
        default=files.max_bytes_per_file,
        help="an output file is closed once it reaches about this many bytes",
    )
    g.add_argument(
        "--num-writers",
        type=int,
        help="writer actors, one open output file each (default: one per 8 engines)",
    )
    g.add_argument(
        "--input-format",
        choices=["parquet", "jsonl", "csv", "hf"],
        help="the input's format (default: from the file names)",
    )
    g.add_argument("--hf-split", help="split of a saved DatasetDict (default: the only one)")
    g.add_argument(
        "--id-column", help="the rows' id column (default: 'id' if present, else a hash of the row)"
    )
    g.add_argument(
        "--keep-columns",
        type=_names,
        default=(),
        help="input columns copied to the output, comma-separated",
    )


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Model, engine, default sampling, plan and compute flags."""
    add_engine_flags(parser)

    d = SamplingParams()
    s = parser.add_argument_group(
        "sampling (defaults; --sampling-columns / --sampling-column override them per row)"
    )
    s.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens to generate")
    # Unset: the model's generation_config.json value (--generation-config auto, as vLLM),
    # else SamplingParams' default.
    model_default = "(default: the model's generation config's, else {})"
    s.add_argument(
        "--temperature", type=float, help="0 is greedy (argmax) " + model_default.format(0.0)
    )
    s.add_argument("--top-k", type=int, help="0 or -1: no top-k filter " + model_default.format(0))
    s.add_argument("--top-p", type=float, help="1: no nucleus filter " + model_default.format(1.0))
    s.add_argument(
        "--repetition-penalty", type=float, help="1: no penalty " + model_default.format(1.0)
    )
    s.add_argument("--seed", type=int, help="sampling seed (default: none, not reproducible)")
    s.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    s.add_argument(
        "--n",
        type=int,
        default=d.n,
        help="samples per row, one output row each (same id, a sample_index column); the "
        "row's prompt is prefilled once; with --seed, sample i draws from seed + i",
    )
    s.add_argument(
        "--best-of",
        type=int,
        help="generate this many samples per row and keep the --n with the highest "
        "cumulative logprob (default: --n)",
    )
    add_guided_args(s)

    plan, compute = PlanConfig(), ComputeConfig()
    p = parser.add_argument_group("plan")
    p.add_argument(
        "--no-prefix-grouping",
        action="store_true",
        help="no shuffle by prefix, no groups (for comparison)",
    )
    p.add_argument(
        "--max-rows-per-shard",
        type=int,
        default=plan.max_rows_per_shard,
        help="rows an engine actor takes at once (a prefix group larger than this is split)",
    )
    p.add_argument(
        "--max-tokens-per-shard",
        type=int,
        default=plan.max_tokens_per_shard,
        help="prompt tokens an engine actor takes at once",
    )
    p.add_argument(
        "--num-partitions", type=int, help="shuffle partitions (default: from the input size)"
    )
    p.add_argument(
        "--on-duplicate",
        choices=["error", "first"],
        default="error",
        help="rows sharing an id with different content: an error row each (default), or "
        "generate the first one read; identical rows are generated once either way",
    )
    p.add_argument(
        "--no-nested-groups",
        action="store_true",
        help="give the engine only first-level prefix groups (no common openings shared)",
    )
    p.add_argument(
        "--prefix-key-tokens",
        type=int,
        default=plan.key_block_size,
        help="leading tokens hashed into the shuffle key: rows sharing fewer are not grouped; "
        "fewer tokens group more, but rows with a common opening all meet in one partition",
    )

    c = parser.add_argument_group("compute")
    c.add_argument(
        "--num-actors",
        type=_actor_count,
        default=compute.num_actors,
        help="engine actors, or auto: on CPU nodes one per --torch-threads cores (1 when unset) "
        "that memory holds, where the rows are enough to pay for their start; one on GPUs",
    )
    c.add_argument(
        "--engines-per-actor",
        type=_actor_count,
        default=compute.engines_per_actor,
        help="CPU engines in each engine actor, each stepped by a thread of its own, or auto: "
        "a single node's auto-counted engines in pairs (one process start each), else 1",
    )
    c.add_argument(
        "--num-gpus-per-actor", type=float, help="default: 1 when the cluster has GPUs, else 0"
    )
    c.add_argument(
        "--num-cpus-per-actor",
        type=float,
        default=compute.num_cpus_per_actor,
        help="CPUs Ray reserves per engine actor (on CPU machines; default 0.5, less for "
        "auto-counted engines that would leave no node a whole CPU)",
    )
    c.add_argument(
        "--actor-resource",
        action="append",
        default=[],
        metavar="NAME=N",
        help="a custom resource per engine actor",
    )
    c.add_argument(
        "--memory-gb-per-actor",
        type=float,
        help="memory Ray reserves per engine actor (keeps engines off small nodes)",
    )
    c.add_argument(
        "--engine-retries",
        type=int,
        default=compute.engine_retries,
        help="fresh tp/pp engines per shard after a worker dies mid-step (then the job fails)",
    )
    c.add_argument(
        "--placement-timeout-s",
        type=float,
        default=compute.placement_timeout_s,
        help="how long to wait for the tp x pp engines' placement groups",
    )
    c.add_argument(
        "--wait-for-nodes",
        action="store_true",
        help="an autoscaling cluster: wait for nodes instead of failing when the nodes up now "
        "cannot hold the engine actors",
    )
    c.add_argument(
        "--torch-threads", type=int, help="torch threads per engine actor (default: torch's)"
    )
    c.add_argument(
        "--allocator",
        choices=ALLOCATORS,
        default=compute.allocator,
        help="the engine actors' malloc: tcmalloc where the machine has it (auto), tcmalloc "
        "(exit 2 without it), or the system's",
    )
    c.add_argument(
        "--num-tokenize-actors",
        type=int,
        default=compute.num_tokenize_actors,
        help="tokenizer actors (CPU)",
    )
    c.add_argument(
        "--num-cpus", type=int, help="CPUs of a local Ray started by this command (default: all)"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def job_config(
    args: argparse.Namespace, prompt: PromptConfig, text_column: str = JobConfig.text_column
) -> JobConfig:
    """The JobConfig the flags describe (ValueError on a bad combination). The flags are
    checked before the sampling is resolved, which reads the model's generation config: a
    clash of column names is named even when the model is missing."""
    config = JobConfig(
        input=InputConfig(
            path=args.input,
            format=args.input_format,
            id_column=args.id_column,
            keep_columns=tuple(args.keep_columns),
            hf_split=args.hf_split,
        ),
        prompt=prompt,
        output=args.output,
        engine=engine_config_from_args(args),
        plan=PlanConfig(
            prefix_grouping=not args.no_prefix_grouping,
            max_rows_per_shard=args.max_rows_per_shard,
            max_tokens_per_shard=args.max_tokens_per_shard,
            num_partitions=args.num_partitions,
            key_block_size=args.prefix_key_tokens,
            nested=not args.no_nested_groups,
            on_duplicate=args.on_duplicate,
        ),
        compute=ComputeConfig(
            num_actors=args.num_actors,
            engines_per_actor=args.engines_per_actor,
            num_gpus_per_actor=args.num_gpus_per_actor,
            num_cpus_per_actor=args.num_cpus_per_actor,
            resources=tuple(_resource(r) for r in args.actor_resource),
            torch_threads=args.torch_threads,
            allocator=args.allocator,
            memory_gb_per_actor=args.memory_gb_per_actor,
            engine_retries=args.engine_retries,
            placement_timeout_s=args.placement_timeout_s,
            wait_for_nodes=args.wait_for_nodes,
            num_tokenize_actors=args.num_tokenize_actors,
        ),
        files=FilesConfig(
            max_rows_per_file=args.max_rows_per_file,
            max_bytes_per_file=args.max_bytes_per_file,
            num_writers=args.num_writers,
        ),
        text_column=text_column,
        overwrite=args.overwrite,
        retry_errors=args.retry_errors,
    )
    return replace(config, sampling=job_sampling(args))


def job_sampling(args: argparse.Namespace) -> SamplingParams:
    """The job's default sampling: the flags given, else the model's generation config's
    values (unless --generation-config vllm; logged), else SamplingParams' defaults. Resolved
    here, so the lineage records what the rows are generated with."""
    from actors import generation_defaults

    given = {
        name: getattr(args, name)
        for name in ("temperature", "top_k", "top_p", "repetition_penalty")
        if getattr(args, name, None) is not None
    }
    # Checked first: a bad guided flag exits 2 without reading the model (whose loader
    # imports torch), and is never reported as the model's generation config's fault.
    guided = guided_from_args(args)
    mode = getattr(args, "generation_config", "auto")
    try:
        model = generation_defaults.folder_defaults(args.model, mode)
    except FileNotFoundError as exc:  # an unknown model, named with its flag
        raise FileNotFoundError(f"--model: {exc}") from exc
    generation_defaults.log_choice(args.model, mode, model)
    try:
        return SamplingParams(
            max_tokens=args.max_tokens,
            seed=args.seed,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
            n=args.n,
            best_of=args.best_of,
            guided_decoding=guided,
            **{**model, **given},
        )
    except ValueError as exc:
        if set(model) - set(given):  # the model's value, not a flag, is out of range
            raise ValueError(f"--model {args.model}'s generation_config.json: {exc}") from exc
        raise


def connect_ray(num_cpus: int | None = None, logging_level: int = logging.INFO) -> bool:
    """Join the cluster at RAY_ADDRESS (as under `ray job submit`), else start a local Ray;
    whether it connected. An already connected process (tests) is left as it is (False).
    `logging_level`: Ray's own loggers' (ray.init sets them)."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        context = ray.init(logging_level=logging_level)
    else:
        context = ray.init(num_cpus=num_cpus, logging_level=logging_level)
    if context.dashboard_url:
        logger.info("Ray dashboard: http://%s", context.dashboard_url)
    return True


def run(
    config_fn: Callable[[], JobConfig],
    num_cpus: int | None,
    as_json: bool,
    console_options: ConsoleOptions | None = None,
) -> int:
    """Check, connect, run, print the summary. Bad input exits 2 with the reason, before Ray
    starts. What it prints besides: pipeline/commands/console.py. The summary has the job's phases
    (pipeline/job/phases.py), this command's Ray shutdown among them."""
    clock = JobClock()
    clock.mark("command")
    options = console_options or ConsoleOptions()
    console.quiet_command(options)
    try:
        config = config_fn()
        # Imported after the flags are checked: the job's module imports the engine's stages
        # (torch, ~3 s of CPU), which a bad flag value never needs.
        from pipeline.job.run import claim_output, prepare, run_job

        prepared = prepare(config)
        if options.dry_run:  # before the folder is claimed: a dry run writes nothing
            from pipeline.job.dry_run import dry_run

            print(dry_run(config, prepared).text(config.output))
            return 0
        # Another job's folder, or one another lineage produced: refused here, untouched.
        folder = claim_output(config, prepared)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    clock.mark("checked")
    with folder:
        console.filter_forwarded_logs()
        connected = connect_ray(num_cpus, logging.INFO if options.verbose else logging.WARNING)
        clock.mark("ray_up")
        console.quiet_ray_data(options)
        watch = console.progress_watch(options, prepared.source)
        try:
            with console.filter_stderr():
                summary = run_job(
                    config,
                    prepared=prepared,
                    folder=folder,
                    watch=watch,
                    clock=clock,
                )
        except NoRoomError as exc:  # actors the cluster can never hold: before any work
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if connected:  # our own connection goes down last, on this thread (shutdown.py says why)
        phases = {**summary.phases_s, "shutdown": shutdown_ray()}
        summary = replace(summary, phases_s=phases)
    print(console.summary_text(summary, as_json))
    return 0


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _resource(text: str) -> tuple[str, float]:
    name, sep, amount = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--actor-resource wants NAME=N, got {text!r}")
    return name, float(amount)


def _actor_count(text: str) -> int | str:
    """`--num-actors`, `--engines-per-actor`: a count >= 1 or auto (argparse names the flag
    when this fails)."""
    if text == AUTO_ACTORS:
        return text
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"wants an integer >= 1 or auto, got {text!r}")
    return count
