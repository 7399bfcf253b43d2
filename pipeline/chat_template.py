"""The chat template options of the job, the processor and Serve, as vLLM names them:
`--chat-template` (a file holding a Jinja template, or the template's text) and
`--chat-template-kwargs` (a JSON object of the template's variables, e.g.
`{"enable_thinking": false}` for Qwen3). Both go to `apply_chat_template`
(actors/tokenization.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.config import check_chat_template


def read_chat_template(value: str) -> str:
    """The template's text: the file at `value` when there is one, else `value` itself (as
    vLLM's --chat-template); ValueError for an empty template or a path-like value that
    names no file (a typo should not become a one-line template)."""
    path = Path(value).expanduser()
    looks_like_path = "{" not in value and "\n" not in value and len(value) < 4096
    if looks_like_path and path.is_file():
        text = path.read_text(encoding="utf-8")
    elif looks_like_path and (value.endswith((".jinja", ".j2", ".txt")) or "/" in value):
        raise ValueError(f"--chat-template: no file {value!r}")
    else:
        text = value
    check_chat_template(text, None)
    return text


def parse_template_kwargs(value: str) -> dict[str, Any]:
    """`--chat-template-kwargs` as a dict; ValueError naming the flag unless a JSON object."""
    try:
        kwargs = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--chat-template-kwargs is not JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"--chat-template-kwargs must be a JSON object, got {value[:80]!r}")
    return kwargs
