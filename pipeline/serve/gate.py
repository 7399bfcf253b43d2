"""Admission at the door: a generation request the replica cannot take is answered at once,
before its body is read or its prompt tokenized.

Under overload most of a request's cost before the staging queue is the replica's own work on
it (pulling the body from Serve's proxy, parsing, tokenizing), and a request turned away only
at the staging queue has paid all of it and made every other request wait for it too. The
gate, the replica API's outermost check on POST /v1/completions and /v1/chat/completions,
answers 429 with Retry-After (OpenAI's JSON error body) when

- the replica already has `max_waiting` + `max_num_seqs` generation requests in progress with
  their whole body received (the staging queue would be full by the time this one reached
  it), or
- with a start budget (`max_queue_wait_s`), the requests ahead of it would keep it out of the
  engine longer than that budget at the rate the engine has been finishing requests.

Every request it lets in carries its arrival time (`ARRIVAL_KEY` in the ASGI scope's state);
the staging queue's deadline (`max_queue_wait_s`) counts from then, so body reading and
tokenizing are inside the budget. /health, /metrics and everything else pass untouched.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from pipeline.serve.errors import busy
from pipeline.serve.guard import app_path, send_json

Scope = dict[str, Any]
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
ARRIVAL_KEY = "raypack_arrival"  # scope["state"][ARRIVAL_KEY]: monotonic seconds at the gate


class LoadView(Protocol):
    """What the gate reads of the replica's engine loop (pipeline/serve/staging.EngineLoop)."""

    max_waiting: int
    max_running: int | None
    max_queue_wait_s: float | None

    @property
    def num_running(self) -> int: ...

    def finish_rate(self) -> float | None: ...


def arrival_of(scope: Mapping[str, Any]) -> float | None:
    """When the gate let the request in (monotonic seconds), if it went through one."""
    state = scope.get("state")
    value = state.get(ARRIVAL_KEY) if isinstance(state, dict) else None
    return float(value) if value is not None else None


class AdmissionGate:
    """ASGI middleware: see the module docstring."""

    def __init__(
        self,
        app: Any,
        loop: LoadView,
        retry_after_s: int,
        on_reject: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.loop = loop
        self.retry_after_s = retry_after_s
        self.on_reject = on_reject
        self.clock = clock
        # Generation requests let in, whole body received, not yet answered. A body still
        # arriving does not count: the guard bounds slow senders (pipeline/serve/guard.py), and
        # counting them here would let a flood of slow bodies turn normal requests away.
        self.in_progress = 0
        self.num_refused = 0

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if not _generation(scope):
            await self.app(scope, receive, send)
            return
        reason = self.refusal()
        if reason is not None:
            self.num_refused += 1
            error = busy(reason, self.retry_after_s)
            if self.on_reject is not None:
                self.on_reject(error.status)
            await send_json(send, error.status, error.body(), error.headers)
            return
        # A copy: the state Serve or a server hands in may be shared between requests.
        scope = {**scope, "state": {**(scope.get("state") or {}), ARRIVAL_KEY: self.clock()}}
        counted = False

        async def counting_receive() -> Any:
            nonlocal counted
            message = await receive()
            whole = message.get("type") == "http.request" and not message.get("more_body")
            if whole and not counted:
                counted = True
                self.in_progress += 1
            return message

        try:
            await self.app(scope, counting_receive, send)
        finally:
            if counted:
                self.in_progress -= 1

    def refusal(self) -> str | None:
        """Why a newcomer cannot be taken now, or None."""
        loop = self.loop
        engine_slots = loop.max_running or 0
        capacity = loop.max_waiting + engine_slots
        if self.in_progress >= capacity:
            return (
                f"{self.in_progress} requests are in progress, as many as it waits for and "
                "runs at once"
            )
        budget = loop.max_queue_wait_s
        if budget is None or loop.max_running is None:
            return None
        ahead = self.in_progress - engine_slots + 1  # finishes this one waits for
        if ahead <= 0:
            return None
        rate = loop.finish_rate()
        if rate is None or rate <= 0:
            return None  # no measure yet: the staging queue's deadline still holds
        expected = ahead / rate
        if expected <= budget:
            return None
        return (
            f"{ahead} requests are ahead of this one and the engine finishes about "
            f"{rate:.0f} per second: it could not start within {budget:g} s"
        )


def _generation(scope: Scope) -> bool:
    return (
        scope.get("type") == "http"
        and scope.get("method") == "POST"
        and app_path(scope) in GENERATE_PATHS
    )
