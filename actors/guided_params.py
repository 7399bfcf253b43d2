"""What a guided request asks for: `GuidedDecodingParams` (vLLM's shape), validated when built
without a tokenizer, so a bad schema fails where every other sampling value does (an error
row in the job, a 400 in Serve). Apart from the engine's decoder (`actors/guided.py`), so
`actors.config` can hold the params without importing the engine's request machinery."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # xgrammar loads on the first guided request (actors.config must not)
    import xgrammar

GUIDED_FIELDS = ("json", "regex", "choice", "grammar", "json_object")
# Compact JSON (", " and ": " between items, no free whitespace): xgrammar's any_whitespace
# lets a small model pad its JSON with newlines until max_tokens (vLLM has the same switch,
# `disable_any_whitespace`).
_ANY_WHITESPACE = False
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


@dataclass(frozen=True)
class GuidedDecodingParams:
    """What a request's output must match: exactly one of `json` (a JSON Schema, as a dict
    or its JSON text; stored as compact JSON text), `regex`, `choice` (one of these
    strings), `grammar` (EBNF, xgrammar's GBNF dialect with a `root` rule) or `json_object`
    (any JSON object). vLLM's `GuidedDecodingParams` / `StructuredOutputsParams` fields."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        schema = self.json
        if schema is not None and not isinstance(schema, str):
            if not isinstance(schema, Mapping):
                raise ValueError(
                    f"guided json must be a JSON Schema object, got {type(schema).__name__}"
                )
            object.__setattr__(self, "json", _canonical(schema))
        elif isinstance(schema, str):
            try:
                object.__setattr__(self, "json", _canonical(json.loads(schema)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"guided json is not valid JSON: {exc}") from None
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(
                isinstance(c, str) and c for c in self.choice
            ):
                raise ValueError(f"guided choice must be non-empty strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice:
                raise ValueError("guided choice must list at least one string")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"guided {name} must be a non-empty string, got {value!r}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"guided json_object must be true or false, got {self.json_object!r}")
        given = [name for name in GUIDED_FIELDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"guided decoding takes exactly one of {list(GUIDED_FIELDS)}, got {given or 'none'}"
            )
        check_grammar(self.kind, self.source)

    @property
    def kind(self) -> str:
        """Which field is set: json, regex, choice, grammar or json_object."""
        return next(name for name in GUIDED_FIELDS if getattr(self, name) not in (None, False))

    @property
    def source(self) -> str:
        """The grammar's text (the schema's compact JSON, the regex, the EBNF, the choices
        as a JSON list, "" for json_object): with `kind`, the compile cache's key."""
        if self.choice is not None:
            return json.dumps(list(self.choice))
        return getattr(self, self.kind) if self.kind != "json_object" else ""

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON Schema as a dict (None unless `json` is set)."""
        return None if self.json is None else json.loads(self.json)

    @classmethod
    def coerce(cls, value: Any) -> GuidedDecodingParams | None:
        """The params from what a user passes: None, these params, or a mapping of their
        fields (JSON text of one too: a table column); ValueError naming what is wrong."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"guided_decoding is not JSON: {exc}") from None
        if not isinstance(value, Mapping):
            raise ValueError(
                f"guided_decoding must be a mapping of {list(GUIDED_FIELDS)}, "
                f"got {type(value).__name__}"
            )
        unknown = sorted(set(value) - set(GUIDED_FIELDS))
        if unknown:
            raise ValueError(
                f"unknown guided_decoding field(s) {unknown}; known: {list(GUIDED_FIELDS)}"
            )
        return cls(**{k: v for k, v in value.items() if v is not None})


StructuredOutputsParams = GuidedDecodingParams  # vLLM >= 0.10's name for the same fields


def _canonical(schema: Mapping[str, Any]) -> str:
    # Keys keep the user's order: the grammar writes properties in the schema's order.
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _choice_ebnf(choices: Sequence[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def grammar_of(kind: str, source: str) -> xgrammar.Grammar:
    """The xgrammar grammar of a `GuidedDecodingParams` kind and source."""
    import xgrammar as xgr

    if kind == "json":
        return xgr.Grammar.from_json_schema(source, any_whitespace=_ANY_WHITESPACE)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type":"object"}', any_whitespace=_ANY_WHITESPACE)
    if kind == "regex":
        return xgr.Grammar.from_regex(source)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(_choice_ebnf(json.loads(source)))
    return xgr.Grammar.from_ebnf(source)


# A pure function of its arguments, memoised: a job builds the same row params many times.
@functools.lru_cache(maxsize=256)
def check_grammar(kind: str, source: str) -> None:
    """ValueError with xgrammar's reason when the grammar cannot be built (no tokenizer
    needed: a schema, a regex or an EBNF text alone)."""
    try:
        grammar_of(kind, source)
    except (RuntimeError, ValueError) as exc:
        reason = _CPP_PREFIX.sub("", str(exc).strip().splitlines()[0])
        raise ValueError(f"invalid guided {kind}: {reason}") from None
