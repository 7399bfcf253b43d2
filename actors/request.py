"""A request inside the engine: its tokens, how many are computed, and its KV blocks.

There is no prefill or decode phase (vLLM v1's idea): a request only knows how many of its
tokens have K/V in the cache (`num_computed_tokens`). A step computes the next n tokens of it;
chunked prefill, a prefix hit and a decode are the same thing with different n.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from actors.config import SamplingParams
from actors.outputs import FinishReason, RequestOutput, TokenLogprob


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"  # not admitted, or preempted and waiting to be recomputed
    RUNNING = "running"  # admitted: holds KV blocks and gets tokens each step
    FINISHED = "finished"


@dataclass(eq=False)
class SharedPrefixState:
    """The engine's runtime state of one `packing.PrefixGroup` that shares: the internal
    request that computes the shared prefix once, and how many members still need its
    blocks (`Request.group` points here).

    Groups nest: a group with a `parent` has its prefix request as a member of the parent
    (it starts from the parent's blocks and computes only its own extra tokens), and counts
    among the parent's unfinished members until its own last member finishes.
    """

    prefix: Request
    num_unfinished_members: int  # prompts and child groups that still need the blocks
    parent: SharedPrefixState | None = None

    @property
    def root(self) -> SharedPrefixState:
        """The outermost enclosing group (the whole tree lives on one KV pool)."""
        group = self
        while group.parent is not None:
            group = group.parent
        return group

    @property
    def ready(self) -> bool:
        """True once the prefix's K/V is fully computed (members may take its blocks)."""
        return self.prefix.num_computed_tokens >= self.prefix.num_prompt_tokens


@dataclass(eq=False)  # identity, not field equality: two requests may hold equal tokens
class Request:
    """One sequence: prompt, generated tokens, computed-token count and block table.

    `is_prefix` marks a prefix group's internal request: it computes the shared prefix and
    never samples; its blocks live until the group's last member finishes.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    is_prefix: bool = False
    group: SharedPrefixState | None = None  # its prefix group's state (a prefix request: its own)
    # A sample of a prompt with several (actors/samples.py): the caller's id and its index.
    parent_id: str | None = None
    sample_index: int = 0
    token_ids: list[int] = field(init=False)  # prompt + generated, the sequence itself
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from the cache; -1 until admitted
    block_ids: list[int] = field(default_factory=list)  # the block table
    block_hashes: list[int] = field(default_factory=list)  # hashes of full blocks so far
    num_hashed_blocks: int = 0  # leading blocks already published to the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # Length-dependent rope (actors/rope.py): the length of the forward HF computed the
    # prompt in (the prompt's, 0 until set), and what the KV blocks depend on beyond tokens.
    rope_len: int = 0
    cache_salt: int | None = None
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprob] | None = None
    text: str = ""
    # Incremental detokenization state (vLLM's prefix/read offsets into the output tokens).
    prefix_offset: int = 0
    read_offset: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.rope_len = self.rope_len or self.num_prompt_tokens
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def member_of(self) -> SharedPrefixState | None:
        """The group whose computed prefix starts this request's block table: its own group
        for a member, the enclosing group for a nested group's prefix request."""
        if self.group is None:
            return None
        return self.group.parent if self.is_prefix else self.group

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """Number of generated tokens."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V is not in the cache yet (1 for a request that is decoding)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        """True when the request will get no more tokens."""
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Add a sampled token; its K/V is computed in the next step that schedules it."""
        self.token_ids.append(token_id)

    def to_output(self) -> RequestOutput:
        """What the caller sees of the request now (under its caller's id: a sample's parent)."""
        return RequestOutput(
            request_id=self.parent_id or self.request_id,
            num_prompt_tokens=self.num_prompt_tokens,
            token_ids=tuple(self.token_ids[self.num_prompt_tokens :]),
            text=self.text,
            finished=self.finished,
            finish_reason=self.finish_reason,
            num_cached_tokens=max(self.num_cached_tokens, 0),
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            finished_time=self.finished_time,
            error=self.error,
            logprobs=tuple(self.logprobs) if self.logprobs is not None else None,
            prompt_token_ids=tuple(self.prompt_token_ids),
            sample_index=self.sample_index,
            cumulative_logprob=(
                None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)
            ),
        )
