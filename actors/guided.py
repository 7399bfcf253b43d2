"""Guided (structured) decoding: a request's output held to a JSON Schema, any JSON object, a
regex, a choice among strings or an EBNF grammar, through xgrammar.

Why xgrammar (measured 2026-11-26 on this machine, SmolLM2's 49,152-token vocabulary, JSON
Schemas of four fields; the scripts' figures in docs/benchmarks.md): filling one request's
token bitmask took 1-5 us (xgrammar precomputes each grammar state's context-independent
tokens) against 10 us for llguidance (4.7 ms for 256 rows with its GIL-free parallel fill on
two threads, xgrammar 0.15-1.4 ms on one); a schema compiles in 1-2 ms once the tokenizer is
analysed (about 1.6 s, once per engine). llguidance covers more of JSON Schema and needs no
dependencies; xgrammar refuses at compile time what it does not support (an error row or a
400, never a silently looser output), ships the Hugging Face logits processor the exactness
tests compare against, and has EBNF grammars (outlines-core has none). The step's guided
cost is applying the mask to the logits (a pass over the vocabulary per row), not filling
it: see `apply_bitmask`. Filling is too cheap to hide behind the forward pass as vLLM does
(and the two cores are the forward's), so it runs in line.

`GuidedDecodingParams` is vLLM's shape (`json`, `regex`, `choice`, `grammar`, `json_object`;
vLLM's newer `StructuredOutputsParams` is the same class). It validates its grammar when
built (without a tokenizer), so a bad schema fails where every other sampling value does:
an error row in the job, a 400 in Serve. `GuidedDecoder` is one engine's: it compiles each
distinct grammar once (xgrammar's compiler cache) when a request is added, keeps one matcher
per running request, masks the logits rows of the step's guided requests before sampling and
advances each matcher with the accepted token.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and xgrammar load on the first guided request (actors.config must not)
    import torch
    import xgrammar

    from actors.request import Request

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


def _grammar(kind: str, source: str) -> xgrammar.Grammar:
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
        _grammar(kind, source)
    except (RuntimeError, ValueError) as exc:
        reason = _CPP_PREFIX.sub("", str(exc).strip().splitlines()[0])
        raise ValueError(f"invalid guided {kind}: {reason}") from None


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set `logits[rows[k], t]` to -inf where bit t of `bitmask[k]` is 0 (in place).

    On CPU by numpy's `unpackbits` and one `torch.where`: at 256 rows of 49,152 tokens,
    9-10 ms with few tokens allowed (JSON structure) where xgrammar's own CPU kernel took
    59 ms and `masked_fill_` 20 ms (measured on this machine, one thread; xgrammar's kernel
    is faster only on rows with every token allowed, which it skips). On other devices
    xgrammar's kernel."""
    import numpy as np
    import torch

    if logits.device.type != "cpu":
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
        return
    vocab = logits.shape[-1]
    packed = bitmask.numpy().view(np.uint8)  # [len(rows), 4 * words], little-endian bits
    bits = np.unpackbits(packed, axis=-1, count=vocab, bitorder="little")
    allowed = torch.from_numpy(bits.view(np.bool_))  # [len(rows), vocab]
    with torch.inference_mode():  # the step's logits are inference tensors
        banned = logits.new_tensor(float("-inf"))
        if rows == list(range(rows[0], rows[0] + len(rows))):  # contiguous: in place
            block = logits[rows[0] : rows[0] + len(rows)]
            torch.where(allowed, block, banned, out=block)
            return
        index = torch.tensor(rows)
        logits.index_copy_(0, index, torch.where(allowed, logits.index_select(0, index), banned))


class GuidedDecoder:
    """One engine's grammars and matchers. `start` compiles (cached by xgrammar per distinct
    grammar) and makes a request's matcher; `apply` masks the step's logits; `accept`
    advances a matcher; `finish` drops it. The tokenizer is analysed on the first guided
    request, so engines that never see one pay nothing."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the LM head's: rows past the tokenizer's are masked
        self.eos_token_ids = list(eos_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._matchers: dict[str, xgrammar.GrammarMatcher] = {}
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(vocab / 32)] int32, reused

    def compile(self, params: GuidedDecodingParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar for `params` (the HF reference in the tests uses it too)."""
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler.compile_grammar(_grammar(params.kind, params.source))

    def start(self, req: Request) -> None:
        """Make `req`'s matcher (its params have `guided_decoding`)."""
        import xgrammar as xgr

        params = req.params.guided_decoding
        assert params is not None
        self._matchers[req.request_id] = xgr.GrammarMatcher(self.compile(params))

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Set to -inf, in place, the logits `[len(requests), vocab]` of tokens each guided
        request's grammar does not allow next (padding rows of the LM head included)."""
        rows = [i for i, r in enumerate(requests) if r.request_id in self._matchers]
        if not rows:
            return
        bitmask = self._bitmask_rows(len(rows))
        for row, i in enumerate(rows):
            self._matchers[requests[i].request_id].fill_next_token_bitmask(bitmask, row)
        apply_bitmask(logits, bitmask[: len(rows)], rows)

    def accept(self, req: Request, token_id: int) -> bool:
        """Advance `req`'s matcher by its sampled token; True when its grammar has ended
        (the request stops). ValueError if the grammar refuses the token (a bug: the mask
        allowed only what it accepts)."""
        matcher = self._matchers.get(req.request_id)
        if matcher is None:
            return False
        if not matcher.accept_token(token_id):
            raise ValueError(f"the grammar refused token {token_id}")
        return bool(matcher.is_terminated())

    def finish(self, request_id: str) -> None:
        """Forget a finished or aborted request's matcher."""
        self._matchers.pop(request_id, None)

    def _bitmask_rows(self, rows: int) -> torch.Tensor:
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = xgr.allocate_token_bitmask(max(rows, 64), self.vocab_size)
        return self._bitmask
