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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from actors.guided_params import (
    GUIDED_FIELDS,
    GuidedDecodingParams,
    StructuredOutputsParams,
    check_grammar,
    grammar_of,
)

if TYPE_CHECKING:  # torch and xgrammar load on the first guided request
    import torch
    import xgrammar

    from actors.request import Request

# The params live in actors/guided_params.py (actors.config holds them); named here too, where
# users of the decoder look for them.
__all__ = [
    "GUIDED_FIELDS",
    "GuidedDecoder",
    "GuidedDecodingParams",
    "StructuredOutputsParams",
    "apply_bitmask",
    "check_grammar",
]


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
        return self._compiler.compile_grammar(grammar_of(params.kind, params.source))

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
