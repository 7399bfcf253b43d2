"""Incremental detokenization and stop-string detection.

Decoding the whole output each step costs O(n) per token; instead (vLLM's method) decode a
short window before and after the newest tokens and append the difference. A window ending in
U+FFFD is an incomplete UTF-8 character and waits for the next token. A few prompt tokens
lead the window so that the first output token keeps its leading space.
"""

from __future__ import annotations

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
