"""`raypack COMMAND [OPTIONS]`: the console script `pip install .` puts on the PATH."""

from __future__ import annotations

import sys
from collections.abc import Callable

USAGE = """usage: raypack {generate,snippets,serve} [OPTIONS]

commands:
  generate  generate for every row of a prompt table (Parquet/JSONL/CSV in, Parquet out)
  snippets  quote the passage of each document that answers its query (a prefix-sharing job)
  serve     serve the engine online: an OpenAI-compatible API on Ray Serve

`raypack COMMAND --help` lists a command's options with their defaults; `raypack --version`."""


def _command(name: str) -> Callable[..., int]:
    # Imported on demand: `raypack serve --help` need not import the offline job, and back.
    if name == "generate":
        from pipeline.commands.generate import main
    elif name == "snippets":
        from pipeline.commands.snippets import main
    else:
        from pipeline.commands.serve import main
    return main


def version() -> str:
    """The installed raypack's version ("unknown" when run from a checkout not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("raypack")
    except PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a command; the exit status (2 for an unknown command, as argparse does)."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        print(f"raypack {version()}")
        return 0
    name, rest = args[0], args[1:]
    if name not in ("generate", "snippets", "serve"):
        print(f"{USAGE}\n\nraypack: error: unknown command {name!r}", file=sys.stderr)
        return 2
    return _command(name)(rest, prog=f"raypack {name}")
