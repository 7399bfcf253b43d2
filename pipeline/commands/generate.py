"""Generate for every row of a prompt table: Parquet (or JSONL, CSV, a saved HF dataset) in,
Parquet out, resumable.

    raypack generate --input prompts.parquet --output out/gen --prompt-column prompt
    raypack generate --input chats.jsonl --output out/chat --messages-column messages
    raypack generate --input docs.csv --output out/sum --template "Summarise: {text}" --chat

Starts a local Ray, or joins the cluster at RAY_ADDRESS (as under `ray job submit`, which
runs the same code as `python jobs/generate.py`).
"""

from __future__ import annotations

import argparse

from pipeline.chat_template import parse_template_kwargs, read_chat_template
from pipeline.commands.cli import HelpFormatter, add_engine_args, add_io_args, job_config, run
from pipeline.commands.console import ConsoleOptions, add_console_flags
from pipeline.commands.help_groups import lead_with
from pipeline.config import JobConfig, PromptConfig

# Shown first in --help (pipeline/commands/help_groups.py): what most runs set.
COMMON_FLAGS = (
    "--input",
    "--output",
    "--prompt-column",
    "--template",
    "--messages-column",
    "--model",
    "--max-tokens",
)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The generic job's flags."""
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    add_io_args(parser)
    prompt = parser.add_argument_group(
        "prompt (its source: one of --prompt-column, --template, --messages-column, above)"
    )
    source = prompt.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt-column", help="column holding the prompt text")
    source.add_argument(
        "--template", help="str.format template over columns, e.g. '{title}: {body}'"
    )
    source.add_argument(
        "--messages-column", help="column of chat messages (list of {role, content}, or JSON)"
    )
    prompt.add_argument(
        "--chat",
        action="store_true",
        help="render the text as a user message with the chat template",
    )
    prompt.add_argument("--system-prompt", help="system message when --chat is used")
    prompt.add_argument(
        "--no-special-tokens",
        dest="add_special_tokens",
        action="store_false",
        help="tokenize text prompts without the tokenizer's special tokens (BOS...); by default "
        "a text prompt is tokenized as tokenizer(text)",
    )
    prompt.add_argument(
        "--allow-special-tokens-in-messages",
        action="store_true",
        help="tokenize special-token text inside chat messages (e.g. <|im_end|>) as the token; "
        "by default it is plain text, so a row cannot forge a chat turn",
    )
    prompt.add_argument(
        "--chat-template",
        help="a chat template (Jinja) file, or its text, used instead of the tokenizer's "
        "(chat prompts only: --chat or --messages-column); part of the output's lineage",
    )
    prompt.add_argument(
        "--chat-template-kwargs",
        help='JSON object of variables for the chat template, e.g. \'{"enable_thinking": '
        "false}' for Qwen3",
    )
    prompt.add_argument(
        "--sampling-column", help="column of per-row sampling parameters (dict or JSON)"
    )
    prompt.add_argument(
        "--sampling-columns",
        "--override-columns",
        dest="override_columns",
        default="",
        help="comma-separated columns whose values override a sampling parameter of the same "
        "name per row, e.g. temperature,max_tokens (default: none; a column that merely has "
        "such a name changes nothing)",
    )
    prompt.add_argument(
        "--text-column",
        default=JobConfig.text_column,
        help="name of the generated text column",
    )
    add_engine_args(parser)
    add_console_flags(parser)
    lead_with(parser, COMMON_FLAGS)
    return parser


def build_config(args: argparse.Namespace) -> JobConfig:
    """The JobConfig of the parsed flags (ValueError on a bad combination)."""
    overrides = tuple(c.strip() for c in args.override_columns.split(",") if c.strip())
    prompt = PromptConfig(
        prompt_column=args.prompt_column,
        template=args.template,
        messages_column=args.messages_column,
        chat=args.chat,
        system_prompt=args.system_prompt,
        add_special_tokens=args.add_special_tokens,
        allow_special_tokens_in_messages=args.allow_special_tokens_in_messages,
        sampling_column=args.sampling_column,
        override_columns=overrides,
        chat_template=read_chat_template(args.chat_template) if args.chat_template else None,
        chat_template_kwargs=(
            parse_template_kwargs(args.chat_template_kwargs) if args.chat_template_kwargs else None
        ),
    )
    return job_config(args, prompt, text_column=args.text_column)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the job; the exit status."""
    args = build_parser(prog).parse_args(argv)
    return run(lambda: build_config(args), args.num_cpus, args.json, ConsoleOptions.from_args(args))
