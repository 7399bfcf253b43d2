"""Incremental detokenization and stop-string detection.

Decoding the whole output each step costs O(n) per token; instead (vLLM's method) decode a
short window before and after the newest tokens and append the difference. A window ending in
U+FFFD is an incomplete UTF-8 character and waits for the next token. A few prompt tokens
lead the window so that the first output token keeps its leading space.

`StreamCursor` says what of a request's text a stream may send before the request ends: all
but the characters that could still become the start of a stop string, which the engine cuts
once it completes (vLLM's stop buffer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from actors.request import Request

_CONTEXT_TOKENS = 5  # prompt tokens decoded before the output for correct spacing


class Detokenizer:
    """Appends new text to requests and finds stop strings in it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def start(self, request: Request) -> None:
        """Set the decode window before the first output token."""
        context = min(_CONTEXT_TOKENS, request.num_prompt_tokens)
        request.prefix_offset = request.num_prompt_tokens - context
        request.read_offset = request.num_prompt_tokens

    def update(self, request: Request) -> str:
        """Decode the request's newest tokens, append them to `request.text`, return them."""
        ids = request.token_ids
        decode = self.tokenizer.decode
        prefix_text = decode(
            ids[request.prefix_offset : request.read_offset], skip_special_tokens=True
        )
        full_text = decode(ids[request.prefix_offset :], skip_special_tokens=True)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        new_text: str = full_text[len(prefix_text) :]
        request.prefix_offset = request.read_offset
        request.read_offset = len(ids)
        request.text += new_text
        return new_text

    @staticmethod
    def find_stop(request: Request, num_new_chars: int) -> bool:
        """Cut `request.text` at the earliest stop string that ends in the new characters;
        True when one was found (the stop string itself is not kept, as in vLLM)."""
        stops = request.params.stop
        if not stops or not num_new_chars:
            return False
        text = request.text
        best = -1
        for stop in stops:
            # A stop string can straddle the old text and the new characters.
            start = max(0, len(text) - num_new_chars - len(stop) + 1)
            index = text.find(stop, start)
            if index != -1 and (best == -1 or index < best):
                best = index
        if best == -1:
            return False
        request.text = text[:best]
        return True


@dataclass
class StreamCursor:
    """What of a request's growing text a stream may send now, so that the pieces sent add up
    to exactly the finished text (the text an unstreamed answer carries).

    The engine only appends to a request's text, and cuts it at a stop string once one is
    complete (`Detokenizer.find_stop`). A stop string completed later ends in characters that
    are not there yet, so it starts within the last `hold` = (longest stop string - 1)
    characters of the text now: everything before them is final. `sent` never moves back, also
    while the text is shorter than `hold`.
    """

    hold: int
    sent: int = 0  # characters of the text already released

    @classmethod
    def for_stops(cls, stops: Sequence[str]) -> StreamCursor:
        """A cursor holding back what the stop strings `stops` could still cut."""
        return cls(hold=max((len(s) for s in stops), default=1) - 1)

    def release(self, text: str, finished: bool) -> str:
        """The new piece of `text` (the request's whole text so far) that is final now: all of
        the rest when `finished`; '' when nothing new is."""
        end = len(text) if finished else max(self.sent, len(text) - self.hold)
        assert end >= self.sent, f"a stop cut text already sent ({end} < {self.sent})"
        piece = text[self.sent : end]
        self.sent = end
        return piece
