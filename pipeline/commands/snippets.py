"""The search-engine snippet task (BatchLLM's workload): for each (document, query) row, quote
the short passage of the document that answers the query. Rows that share a document share a
prompt prefix, so the planner computes each document once per prefix group.

    raypack snippets --input jobs/data/snippets_sample.jsonl --output out/snippets
    RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python jobs/snippets.py --input jobs/data/snippets_sample.jsonl --output /tmp/snippets

Output column `snippet` (plus the usual result columns; see README "The offline job").
"""

from __future__ import annotations

import argparse

from pipeline.commands.cli import HelpFormatter, add_engine_args, add_io_args, job_config, run
from pipeline.commands.console import ConsoleOptions, add_console_flags
from pipeline.commands.help_groups import lead_with
from pipeline.config import JobConfig, PromptConfig
from pipeline.stages import columns

SYSTEM_PROMPT = (
    "You write search result snippets. Given a document and a search query, reply with the "
    "shortest passage of the document, one or two sentences copied from it, that answers the "
    "query. Reply with the passage only."
)


def snippet_prompt(document_column: str, query_column: str) -> PromptConfig:
    """The chat-templated prompt: the document first (the shared prefix), then the query."""
    for name in (document_column, query_column):
        if not name.isidentifier():
            raise ValueError(f"column names must be identifiers for the template, got {name!r}")
    template = f"Document:\n{{{document_column}}}\n\nQuery: {{{query_column}}}\n\nSnippet:"
    return PromptConfig(template=template, chat=True, system_prompt=SYSTEM_PROMPT)


# Shown first in --help (pipeline/commands/help_groups.py): what most runs set.
COMMON_FLAGS = (
    "--input",
    "--output",
    "--document-column",
    "--query-column",
    "--model",
    "--max-tokens",
)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The snippet job's flags."""
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    add_io_args(parser)
    parser.add_argument("--document-column", default="document", help="the documents' column")
    parser.add_argument(
        "--query-column", default="query", help="the queries' column (kept in the output)"
    )
    parser.add_argument(
        "--output-column", default="snippet", help="name of the generated snippet column"
    )
    add_engine_args(parser)
    # A snippet is a sentence or two: a blank line ends it (small models repeat themselves).
    parser.set_defaults(max_tokens=48, stop=["\n\n"])
    add_console_flags(parser)
    lead_with(parser, COMMON_FLAGS)
    return parser


def build_config(args: argparse.Namespace) -> JobConfig:
    """The JobConfig of the parsed flags (ValueError on a bad combination)."""
    # Named by this command's own flags before JobConfig names them by generate's.
    columns.check_written("--output-column", [args.output_column])
    columns.check_read("--document-column", [args.document_column], args.id_column)
    columns.check_read("--query-column", [args.query_column], args.id_column)
    if not args.keep_columns:  # the query column is kept unless --keep-columns says otherwise
        columns.check_written("--query-column (kept)", [args.query_column], args.output_column)
    keep = args.keep_columns or (args.query_column,)
    args = argparse.Namespace(**{**vars(args), "keep_columns": keep})
    prompt = snippet_prompt(args.document_column, args.query_column)
    return job_config(args, prompt, text_column=args.output_column)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the job; the exit status."""
    args = build_parser(prog).parse_args(argv)
    return run(lambda: build_config(args), args.num_cpus, args.json, ConsoleOptions.from_args(args))
