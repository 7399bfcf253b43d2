"""What the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "error", "abort"]


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one sampled token and the top alternatives at that position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(frozen=True)
class RequestOutput:
    """The state of one request after a step (cumulative), or its final result.

    `finished` is False while tokens are still coming (streaming callers read `token_ids` so
    far); when True, `finish_reason` says why: `stop` (EOS, a stop token or a stop string),
    `length` (max_tokens or the context end), `error` (see `error`), `abort`.
    Times are `time.monotonic()` seconds; `first_token_time` is None until a token exists.
    A prompt with several samples (`SamplingParams.n`) has one output per sample, all with
    its `request_id` and `sample_index` 0..n-1 (actors/samples.py); `cumulative_logprob` is
    the sum of the sampled tokens' logprobs when they were computed.
    """

    request_id: str
    num_prompt_tokens: int
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0  # prompt tokens served from a shared prefix / cached blocks
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_token_ids: tuple[int, ...] = field(default=(), repr=False)
    sample_index: int = 0
    cumulative_logprob: float | None = None

    @property
    def num_generated_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids)

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token (TTFT), None before it."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time
