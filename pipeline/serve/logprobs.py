"""The engine's per-token logprobs in OpenAI's two shapes, as vLLM fills them.

A token's string is the tokenizer's decode of that token id alone (special tokens kept), so a
piece of a multi-byte character reads as U+FFFD, and `bytes` are that string's UTF-8 bytes
(vLLM's choice). Logprobs are the model's log_softmax before temperature, top-k and top-p
(vLLM's default); -inf becomes -9999.0, as OpenAI documents. Every generated token has its
entry, including one whose text a stop string cut and the end-of-sequence token (vLLM's
behaviour: `logprobs` has as many entries as `usage.completion_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from actors.outputs import TokenLogprob
from pipeline.serve.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprobEntry, TopLogprob

FLOOR = -9999.0  # OpenAI's value for "very unlikely" (JSON has no -inf)


class LogprobShaper:
    """Builds OpenAI logprobs bodies from `TokenLogprob`s with one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        """A token decoded alone, as vLLM's logprobs show it."""
        return str(self.tokenizer.decode([token_id]))

    def completion(self, entries: Sequence[TokenLogprob], offset: int = 0) -> CompletionLogprobs:
        """The legacy shape; `offset` is the text_offset of the first entry (in a stream: the
        characters of the tokens already sent)."""
        tokens = [self.token(e.token_id) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        top = []
        for entry in entries:
            # The k best, then the sampled token if it is not among them (up to k + 1, as
            # OpenAI documents); best first. Two ids decoding alike keep the better logprob.
            best: dict[str, float] = {}
            for token_id, logprob in (*entry.top, (entry.token_id, entry.logprob)):
                best.setdefault(self.token(token_id), _finite(logprob))
            top.append(best)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[_finite(e.logprob) for e in entries],
            top_logprobs=top,
            text_offset=offsets,
        )

    def chat(self, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
        """The chat shape: `content`, one entry per token with its `top_logprobs` best first."""
        return ChatLogprobs(
            content=[
                TokenLogprobEntry(
                    **self._top(entry.token_id, entry.logprob).model_dump(),
                    top_logprobs=[self._top(t, lp) for t, lp in entry.top],
                )
                for entry in entries
            ]
        )

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.token(token_id)
        return TopLogprob(
            token=token, logprob=_finite(logprob), bytes=list(token.encode("utf-8", "replace"))
        )


def _finite(logprob: float) -> float:
    return max(float(logprob), FLOOR)
