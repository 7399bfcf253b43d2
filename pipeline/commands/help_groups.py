"""`--help` that starts with what most runs need: the job commands have some 60 flags, grouped
by what they set (input and output, prompt, engine, sampling, plan, compute, console); the
handful a first run uses (input, output, prompt source, model, max tokens) are shown first,
in a group of their own, the rest below in their groups.

argparse prints groups in the order they were made and has no public way to move an option
between groups; the flags are defined next to what they set (pipeline/commands/cli.py,
pipeline/engine_flags.py), so the common ones are moved afterwards, through the parser's
`_action_groups` / `_group_actions` lists (unchanged in argparse since Python 3.2)."""

from __future__ import annotations

import argparse

COMMON_TITLE = "common options (most runs need only these; the rest are grouped below)"


def lead_with(parser: argparse.ArgumentParser, flags: tuple[str, ...]) -> None:
    """Show `flags` (option strings, e.g. "--input") first in `parser`'s help, in this order,
    in a group of their own, and only them in the usage line (with "[options]" for the rest);
    parsing is unchanged. KeyError for a flag the parser lacks."""
    actions = {s: a for a in parser._actions for s in a.option_strings}
    common = parser.add_argument_group(COMMON_TITLE)
    for flag in flags:
        action = actions[flag]
        for group in parser._action_groups:
            if action in group._group_actions:
                group._group_actions.remove(action)
        common._group_actions.append(action)
    parser._action_groups.remove(common)
    parser._action_groups.insert(0, common)
    formatter = parser._get_formatter()
    formatter.add_usage(None, common._group_actions, parser._mutually_exclusive_groups, "")
    parser.usage = formatter.format_help().strip().replace("%", "%%") + " [options]"
