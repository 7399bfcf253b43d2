"""The job's guided-decoding flags: `--json-schema FILE`, `--json-object`, `--regex`,
`--choice a,b,c`, `--grammar FILE` (at most one), read into `GuidedDecodingParams`."""

from __future__ import annotations

import argparse
from pathlib import Path

from actors.guided import GuidedDecodingParams

_FLAGS = ("json_schema", "json_object", "regex", "choice", "grammar")


def add_guided_args(group: argparse._ArgumentGroup) -> None:
    """The flags, in the sampling group (a row's `guided_decoding` column overrides them)."""
    group.add_argument(
        "--json-schema",
        metavar="FILE",
        help="hold every output to this JSON Schema (rows get a `parsed` column)",
    )
    group.add_argument(
        "--json-object", action="store_true", help="hold every output to a JSON object"
    )
    group.add_argument("--regex", help="hold every output to this regular expression")
    group.add_argument("--choice", help="every output is one of these strings (comma-separated)")
    group.add_argument(
        "--grammar", metavar="FILE", help="hold every output to this EBNF grammar (root ::= ...)"
    )


def guided_from_args(args: argparse.Namespace) -> GuidedDecodingParams | None:
    """The guided decoding the flags ask for, or None; ValueError naming the flag (the
    command exits 2) when a file cannot be read, flags are combined or the grammar is bad."""
    given = [f for f in _FLAGS if getattr(args, f, None)]
    if not given:
        return None
    flag = "--" + given[0].replace("_", "-")
    if len(given) > 1:
        raise ValueError(
            f"give one of --json-schema, --json-object, --regex, --choice, --grammar; got {given}"
        )
    try:
        if given[0] == "json_schema":
            return GuidedDecodingParams(json=_read(args.json_schema))
        if given[0] == "grammar":
            return GuidedDecodingParams(grammar=_read(args.grammar))
        if given[0] == "choice":
            choices = tuple(c.strip() for c in args.choice.split(",") if c.strip())
            return GuidedDecodingParams(choice=choices)
        if given[0] == "regex":
            return GuidedDecodingParams(regex=args.regex)
        return GuidedDecodingParams(json_object=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag}: {exc}") from None


def _read(path: str) -> str:
    return Path(path).read_text(encoding="utf-8")
