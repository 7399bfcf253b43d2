"""Prefix-affinity routing: a request goes to the replica that last served its longest prefix.

Ray Serve routes an HTTP request from its proxy with the ASGI scope alone (the body follows
later, pulled by the replica), so no request router, Ray's PrefixCacheAffinityRouter included,
sees a prompt there. With prefix routing on, a thin front deployment (pipeline/serve/front.py)
reads the body and calls the engine replicas through a handle with a `RoutedRequest`, and
`PrefixAffinityRouter` (Serve's request-router API) routes that call.

The key is the raw prompt text (a completion's prompt, or a chat's roles and contents) cut in
fixed-size character chunks and hashed with the engine's own chained block hashing
(packing/keys.py `block_hashes`, over code points instead of token ids): the front needs no
tokenizer or chat template (loading them and tokenizing a long prompt twice, in the front and
again in the replica, would cost more than routing saves), and equal leading chunks of text give
equal leading token blocks in all but the chunk where the texts part.
"""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import LocalityMixin, MultiplexMixin, RequestRouter

from packing.keys import block_hashes
from pipeline.serve.protocol import json_value

CHUNK_CHARS = 256  # characters per routing chunk (~ 4 KV blocks of 16 tokens of English)
MAX_CHUNKS = 512  # prefixes are keyed up to this many chunks (128 KiB of text)


@dataclass(frozen=True)
class RoutedRequest:
    """One HTTP request as the front passes it on: its ASGI scope, the body it read (whole
    unless `complete` is False) and the chained hashes of its prompt's leading chunks."""

    scope: dict[str, Any]
    body: bytes
    complete: bool = True
    prefix: tuple[int, ...] = field(default=())


def routing_text(body: bytes) -> str:
    """The text a request's prompt starts with: a completion's prompt (the first of a list),
    or a chat's messages as `role\\ncontent\\n`; '' when the body is not such a request (the
    replica answers it as it would anyway)."""
    request = json_value(body)  # as the replica parses it (json.loads recurses without bound)
    if not isinstance(request, dict):
        return ""
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    messages = request.get("messages")
    if not isinstance(messages, list):
        return ""
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            break
        parts.append(f"{message.get('role', '')}\n{_content_text(message.get('content'))}\n")
    return "".join(parts)


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def prefix_hashes(text: str, chunk_chars: int = CHUNK_CHARS) -> tuple[int, ...]:
    """Chained hashes of the whole `chunk_chars`-character chunks of `text` (at most
    MAX_CHUNKS): equal leading chunks give equal leading hashes."""
    head = text[: chunk_chars * MAX_CHUNKS]
    return tuple(block_hashes([ord(c) for c in head], chunk_chars))


class PrefixTable:
    """Which replica last took each prefix chunk hash, oldest first out beyond `capacity`."""

    def __init__(self, capacity: int = 200_000) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._owner: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def longest_match(
        self, prefix: tuple[int, ...], candidates: Collection[str]
    ) -> tuple[str, int]:
        """The candidate holding the longest leading run of `prefix`, and that run's length in
        chunks (('', 0) if none). Hashes are chained, so the deepest known hash names it."""
        for depth in range(len(prefix), 0, -1):
            owner = self._owner.get(prefix[depth - 1])
            if owner is not None and owner in candidates:
                return owner, depth
        return "", 0

    def record(self, prefix: tuple[int, ...], replica: str) -> None:
        """`replica` now holds `prefix` (each of its chunks)."""
        for key in prefix:
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, replica: str) -> None:
        """Drop everything `replica` held (it is gone)."""
        for key in [k for k, owner in self._owner.items() if owner == replica]:
            del self._owner[key]


def choose_by_prefix(
    table: PrefixTable,
    prefix: tuple[int, ...],
    loads: Mapping[str, int | None],
    *,
    min_match_chunks: int,
    saturated_at: int,
) -> str | None:
    """The replica (a key of `loads`) to send `prefix` to, or None for Serve's default.

    None when the longest match is shorter than `min_match_chunks`, or when the matched
    replica has `saturated_at` or more requests in progress (its `loads` entry; None: unknown,
    taken as not saturated) while another candidate has fewer.
    """
    replica, depth = table.longest_match(prefix, loads.keys())
    if depth < max(1, min_match_chunks):
        return None
    load = loads[replica]
    if load is not None and load >= saturated_at:
        others = [n for r, n in loads.items() if r != replica]
        if any(n is None or n < load for n in others):
            return None
    return replica


class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Serve's request-router API: a `RoutedRequest` goes to the replica holding its longest
    prefix (at least `min_match_chunks` chunks, unless that replica is saturated); anything
    else by Serve's default, power of two choices. Not FIFO: each routing task serves its own
    request, so a request goes where its own prefix says. The table is this router's (one per
    handle, i.e. per front replica)."""

    def initialize_state(  # type: ignore[override]
        self, min_match_chunks: int = 2, saturated_at: int = 8, capacity: int = 200_000
    ) -> None:
        self._table = PrefixTable(capacity)
        self._min_match_chunks = min_match_chunks
        self._saturated_at = saturated_at

    async def choose_replicas(self, candidate_replicas, pending_request=None):  # type: ignore[no-untyped-def]
        fallback = await PowerOfTwoChoicesRequestRouter.choose_replicas(  # Serve's default
            self,  # type: ignore[arg-type]
            candidate_replicas=candidate_replicas,
            pending_request=pending_request,
        )
        prefix = _prefix_of(pending_request)
        if not prefix or not fallback:
            return fallback
        # Serve calls on_request_routed only when it enforces max_ongoing_requests strictly:
        # learn where the request went from its future instead (set to the chosen replica).
        pending_request.future.add_done_callback(functools.partial(self._routed, prefix))
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        cache = self._replica_queue_len_cache
        loads = {key: cache.get(r.replica_id) for key, r in by_id.items()}
        choice = choose_by_prefix(
            self._table,
            prefix,
            loads,
            min_match_chunks=self._min_match_chunks,
            saturated_at=self._saturated_at,
        )
        return [[by_id[choice]]] if choice is not None else fallback

    def _routed(self, prefix: tuple[int, ...], future: asyncio.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is None:
            self._table.record(prefix, future.result().replica_id.unique_id)

    def on_replica_actor_died(self, replica_id):  # type: ignore[no-untyped-def]
        super().on_replica_actor_died(replica_id)
        self._table.forget(replica_id.unique_id)


def _prefix_of(pending_request: Any) -> tuple[int, ...]:
    # By its fields, not isinstance: Serve ships the router class to the handle by value, so
    # its RoutedRequest need not be the class the front built the request with.
    if pending_request is None:
        return ()
    for arg in pending_request.args:
        prefix = getattr(arg, "prefix", None)
        if isinstance(prefix, tuple) and hasattr(arg, "scope"):
            return prefix
    return ()
