"""The staging queue and the step loop that drives the engine inside a replica.

Requests wait in the staging queue until the admission controller lets a group of them into
the engine (one packed prefill). The loop is one asyncio task: between steps it applies aborts,
asks the controller, and adds the admitted requests; each `engine.step()` runs in a dedicated
one-thread executor, so the event loop keeps accepting requests and streaming tokens while the
model computes. The engine is only ever touched from that thread or between steps, never both.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from actors.outputs import RequestOutput
from packing.admission import AdmissionConfig, AdmissionController

if TYPE_CHECKING:
    from actors.config import SamplingParams
    from pipeline.serve.metrics import ServeMetrics

logger = logging.getLogger(__name__)

# The engine's finish rate (what the admission gate predicts a newcomer's wait from) is measured
# over the finishes of this many last seconds of busy time.
RATE_WINDOW_S = 10.0


class StepEngine(Protocol):
    """What the loop needs from the engine (actors.LLMEngine has it)."""

    def add_request(
        self, prompt: str | list[int], params: Any = None, request_id: str | None = None
    ) -> str: ...

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished(self) -> bool: ...


class QueueFullError(Exception):
    """The staging queue is at capacity; the caller should answer 429."""


class EngineFailedError(Exception):
    """The engine raised while this request was in it."""


class QueueTimeoutError(Exception):
    """The request waited longer than the replica's max_queue_wait_s; the caller answers 429."""


@dataclass
class _Request:
    """One request from submission to its last output."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float  # entered the staging queue
    since: float  # the start budget (max_queue_wait_s) counts from here: arrival at the replica
    # The latest output of each sample (SamplingParams.n), by sample index.
    samples: dict[int, RequestOutput] = field(default_factory=dict)
    error: BaseException | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class RequestStream:
    """The outputs of one request as they come; each item is cumulative (all tokens so far)
    for one sample (`sample_index`; a request with `n` > 1 has n), until every sample has
    finished.

    A slow reader skips intermediate outputs (they are cumulative), so nothing queues up.
    Leaving the iteration early (client gone, task cancelled) aborts the request.
    """

    def __init__(self, loop: EngineLoop, request: _Request) -> None:
        self._loop = loop
        self._request = request

    @property
    def request_id(self) -> str:
        """The engine request id."""
        return self._request.request_id

    @property
    def arrival(self) -> float:
        """When the request entered the staging queue (monotonic seconds)."""
        return self._request.arrival

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        request = self._request
        seen: dict[int, RequestOutput] = {}
        done = False
        try:
            while not done:
                await request.changed.wait()
                request.changed.clear()
                if isinstance(request.error, QueueTimeoutError):
                    raise request.error
                if request.error is not None:
                    raise EngineFailedError(str(request.error)) from request.error
                for index, output in sorted(request.samples.items()):
                    if seen.get(index) is not output:
                        seen[index] = output
                        yield output
                done = _all_finished(seen, request.params.n)
        finally:
            if not done:
                self._loop.abort(request.request_id)


def step_thread(torch_threads: int | None = None) -> ThreadPoolExecutor:
    """The thread a replica's engine is built and stepped in: one thread runs all of the
    engine's torch work (actors/build_thread.py says why). `torch_threads` is set in that
    thread (torch keeps the count per thread); None keeps torch's default there."""
    return ThreadPoolExecutor(
        max_workers=1,
        thread_name_prefix="engine-step",
        initializer=_set_torch_threads,
        initargs=(torch_threads,),
    )


def _set_torch_threads(count: int | None) -> None:
    if count is not None:
        import torch  # the replica's process has it; the staging queue alone does not need it

        torch.set_num_threads(count)


class EngineLoop:
    """Owns the engine in a replica: staging queue, admission controller, step loop, streams."""

    def __init__(
        self,
        engine: StepEngine,
        admission: AdmissionConfig,
        *,
        max_waiting: int,
        max_running: int | None = None,
        max_queue_wait_s: float | None = None,
        metrics: ServeMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        self.engine = engine
        self.controller = AdmissionController(admission)
        self.max_waiting = max_waiting
        # Requests in the engine at most; the rest wait here, so the staging queue is the only
        # queue and its bound (429 beyond) holds whatever the policy.
        self.max_running = max_running
        self.max_queue_wait_s = max_queue_wait_s  # shed requests waiting longer (None: never)
        self.num_shed = 0  # requests answered 429 after waiting max_queue_wait_s
        self._finished_at: deque[float] = deque()  # finish times within RATE_WINDOW_S
        self._busy_since: float | None = None  # the engine has had work since then
        self._metrics = metrics
        self._clock = clock
        self._waiting: OrderedDict[str, _Request] = OrderedDict()
        self._running: dict[str, _Request] = {}
        self._aborts: set[str] = set()
        self.num_aborted = 0  # requests dropped because their client went away
        self._wakeup = asyncio.Event()
        self._ids = itertools.count()
        # The engine's steps run in this one thread; `executor` is the one that built the engine
        # (step_thread(): the engine's torch work in one thread, see there).
        self._executor = executor or step_thread()
        self._task: asyncio.Task[None] | None = None

    @property
    def num_waiting(self) -> int:
        """Requests in the staging queue."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests admitted to the engine and not finished."""
        return len(self._running)

    @property
    def alive(self) -> bool:
        """True while the step loop task runs."""
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the step loop on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        """Stop the loop and the step thread."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    def set_admission(self, admission: AdmissionConfig) -> None:
        """Switch the admission rule (a fresh controller: N_t cold-starts at n_min)."""
        self.controller = AdmissionController(admission)
        self._wakeup.set()
        logger.info("admission policy now %s", admission)

    def finish_rate(self) -> float | None:
        """Requests the engine finished per second over the last RATE_WINDOW_S seconds it was
        busy; None before it has been busy a second or when nothing finished in the window."""
        if self._busy_since is None:
            return None
        now = self._clock()
        while self._finished_at and self._finished_at[0] < now - RATE_WINDOW_S:
            self._finished_at.popleft()
        span = min(RATE_WINDOW_S, now - self._busy_since)
        if span < 1.0 or not self._finished_at:
            return None
        return len(self._finished_at) / span

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival: float | None = None,
    ) -> RequestStream:
        """Put a request in the staging queue; QueueFullError when it is at capacity.
        `arrival`: when the request reached the replica (this loop's clock; default now), the
        start of its max_queue_wait_s."""
        if len(self._waiting) >= self.max_waiting:
            raise QueueFullError(f"{len(self._waiting)} requests are already waiting")
        now = self._clock()
        since = now if arrival is None else min(arrival, now)
        request = _Request(f"srv-{next(self._ids)}", list(prompt_token_ids), params, now, since)
        self._waiting[request.request_id] = request
        self.controller.observe_arrival(now)
        self._wakeup.set()
        return RequestStream(self, request)

    def abort(self, request_id: str) -> None:
        """Drop a request: from the staging queue now, from the engine before its next step."""
        if self._waiting.pop(request_id, None) is not None:
            self.num_aborted += 1
            return
        if request_id in self._running:
            self._aborts.add(request_id)
            self._wakeup.set()

    async def _run(self) -> None:
        while True:
            try:
                await self._turn()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 (the loop must outlive any failure)
                # Not one request's fault (those are caught where they happen): fail the
                # running requests, as a failed step does, and keep serving newcomers.
                logger.exception("the step loop failed; failing %d requests", self.num_running)
                self._fail_running(exc)
                await asyncio.sleep(0.01)  # never spin if the failure repeats

    async def _turn(self) -> None:
        """One pass: aborts, admission, then a step (or a wait for work)."""
        self._wakeup.clear()
        self._apply_aborts()
        self._shed_late()
        wake_at = self._admit()
        if self.engine.has_unfinished():
            loop = asyncio.get_running_loop()
            try:
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as exc:  # noqa: BLE001 (fail the requests, keep serving)
                logger.exception("engine step failed; failing %d requests", self.num_running)
                self._fail_running(exc)
                return
            self._dispatch(outputs)
            return
        if self._waiting and self.max_queue_wait_s is not None:  # wake to shed the oldest
            shed_at = min(r.since for r in self._waiting.values()) + self.max_queue_wait_s
            wake_at = shed_at if wake_at is None else min(wake_at, shed_at)
        timeout = None if wake_at is None else max(0.0, wake_at - self._clock())
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout)
        except TimeoutError:
            pass

    def _shed_late(self) -> None:
        """Answer (429) the waiting requests that reached the replica longer than
        max_queue_wait_s ago."""
        if self.max_queue_wait_s is None:
            return
        now = self._clock()
        for request in list(self._waiting.values()):
            waited = now - request.since
            if waited <= self.max_queue_wait_s:
                continue
            del self._waiting[request.request_id]
            self.num_shed += 1
            request.error = QueueTimeoutError(
                f"the request waited {waited:.1f} s for the engine since it reached the "
                f"replica (max_queue_wait_s "
                f"{self.max_queue_wait_s:g})"
            )
            request.changed.set()

    def _admit(self) -> float | None:
        """Hand the admitted group to the engine; return when to ask again if nothing changes."""
        oldest = next(iter(self._waiting.values())).arrival if self._waiting else None
        now = self._clock()
        decision = self.controller.decide(now, len(self._waiting), oldest)
        count = decision.count
        if self.max_running is not None:
            count = min(count, max(0, self.max_running - len(self._running)))
        if count and self._busy_since is None:
            self._busy_since = now
        for _ in range(count):
            _, request = self._waiting.popitem(last=False)
            try:
                self.engine.add_request(
                    request.prompt_token_ids, request.params, request.request_id
                )
            except Exception as exc:  # noqa: BLE001 (this request's fault: fail it alone)
                logger.exception("admitting %s failed; failing it alone", request.request_id)
                self._fail(request, exc)
                continue
            self._running[request.request_id] = request
            if self._metrics is not None:
                self._metrics.record_queued(now - request.arrival)
        if count and logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "admitted %d (%s), N_t=%d",
                count,
                decision.reason,
                self.controller.threshold,
            )
        return decision.wake_at

    def _apply_aborts(self) -> None:
        for request_id in self._aborts:
            request = self._running.pop(request_id, None)
            if request is not None:
                self.num_aborted += 1
                self.engine.abort_request(request_id)
                logger.info("aborted %s (client gone)", request_id)
        self._aborts.clear()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = self._clock()
        ttfts: list[float] = []
        new_tokens = 0
        for output in outputs:
            request = self._running.get(output.request_id)
            if request is None:  # aborted while the step ran
                continue
            before = request.samples.get(output.sample_index)
            previous = len(before.token_ids) if before is not None else 0
            new = max(0, len(output.token_ids) - previous)
            new_tokens += new
            if request.first_token_at is None and output.token_ids:
                request.first_token_at = now
                ttfts.append(now - request.arrival)
                if self._metrics is not None:
                    self._metrics.record_first_token(
                        now - request.arrival, output.num_prompt_tokens, output.num_cached_tokens
                    )
            if new and self._metrics is not None:
                gap = None if request.last_token_at is None else now - request.last_token_at
                self._metrics.record_tokens(new, gap)
            if new:
                request.last_token_at = now
            request.samples[output.sample_index] = output
            request.changed.set()
            if _all_finished(request.samples, request.params.n):
                del self._running[output.request_id]
                self._finished_at.append(now)
                self._record_finished(request, output, now)
        if not self._running and not self._waiting:  # idle: the next busy spell measures anew
            self._busy_since = None
            self._finished_at.clear()
        self.controller.observe_ttfts(ttfts)
        if self._metrics is not None:
            self._metrics.record_step(
                new_tokens, self.num_waiting, self.num_running, self.controller.threshold
            )

    def _record_finished(self, request: _Request, output: RequestOutput, now: float) -> None:
        if self._metrics is None:
            return
        tpot = None
        if request.first_token_at is not None and len(output.token_ids) > 1:
            tpot = (now - request.first_token_at) / (len(output.token_ids) - 1)
        self._metrics.record_finished(
            output.finish_reason or "unknown",
            now - request.arrival,
            tpot,
            output.num_prompt_tokens,
            output.num_cached_tokens,
        )

    def _fail(self, request: _Request, exc: BaseException) -> None:
        """End one request with an error (its stream raises EngineFailedError)."""
        request.error = exc
        request.changed.set()
        try:
            self.engine.abort_request(request.request_id)
        except Exception:  # noqa: BLE001 (the engine is already broken)
            logger.debug("abort after failure raised", exc_info=True)

    def _fail_running(self, exc: BaseException) -> None:
        for request in list(self._running.values()):
            self._fail(request, exc)
        self._running.clear()


def _all_finished(samples: dict[int, RequestOutput], n: int) -> bool:
    """Whether each of a request's n samples has its final output."""
    return len(samples) == n and all(out.finished for out in samples.values())
