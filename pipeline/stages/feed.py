"""One engine, stepped by a thread of its own, fed shards from any thread (continuous feed).

The engine actor runs several shard tasks at once (Ray Data's `max_concurrent_calls_per_actor`);
each task `submit`s its shard and waits for the shard's outputs. The feed thread queues every
new shard's prompts (`LLMEngine.add_prompts`, with its prefix groups) between two steps, so
while one shard's last sequences decode the next shard's prompts are already in the running
batch: the batch never drains at a shard boundary. A shard's future resolves when its last
request finishes; nothing of a shard is returned (or written) before that.

The engine is not thread-safe: only the feed thread touches it once the feed is started.
Given no engine, the feed builds it in the feed thread, so that one thread runs all of the
engine's torch work (actors/build_thread.py says why: with the engine built in the actor's
constructor thread, the job's engine steps ran at 0.84x the same engine in one thread).

Failures: a tensor/pipeline-parallel `WorkerFailedError` takes the whole engine down, so the
feed builds a fresh one and queues every unfinished shard again from the start, each up to
`engine_retries` times (past that, that shard's future fails with the cause). Any other
exception from the engine fails the shards that were in it (their rows get an error) and
the feed aborts their requests and goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from actors.config import SamplingParams
from actors.gc_pause import freeze_heap, gc_paused
from actors.outputs import RequestOutput
from actors.parallel.errors import WorkerFailedError

logger = logging.getLogger(__name__)


@dataclass
class _Shard:
    """A submitted shard: its prompts, and the outputs of the requests it queued."""

    shard_id: str
    prompts: list
    params: list[SamplingParams]
    groups: list
    future: Future = field(default_factory=Future)
    attempts: int = 0  # engines it has been queued on
    request_ids: list[str] = field(default_factory=list)
    # A prompt's outputs, one per sample (SamplingParams.n), by sample index.
    results: dict[str, dict[int, RequestOutput]] = field(default_factory=dict)
    num_results: int = 0
    num_samples: dict[str, int] = field(default_factory=dict)  # request id -> its n

    def expected(self) -> int:
        """Outputs the shard ends with: `n` per prompt."""
        return sum(self.num_samples.values())

    def outputs(self) -> list[RequestOutput]:
        """In prompt order, a prompt's samples one after the other."""
        return [out for rid in self.request_ids for _, out in sorted(self.results[rid].items())]


class EngineFeed:
    """Steps `engine` in a daemon thread; `submit` queues a shard and returns its future.

    `new_engine` builds a replacement after a worker failure; `close_engine` stops a failed
    engine's workers. `torch_threads` is set in the feed thread itself: torch keeps the intra-op
    thread count per thread for MKL (`mkl_set_num_threads_local`), and a fresh thread starts
    from OMP_NUM_THREADS, which Ray sets to 1 in a fractional-CPU actor. `on_finished` is
    called (in the feed thread) with a prompt's outputs, one per sample, when its last sample
    finishes (the job's progress counts rows: pipeline/job/progress.py).
    """

    def __init__(
        self,
        engine: Any,  # actors.LLMEngine (or a stand-in), or None: built by `new_engine`
        new_engine: Callable[[], Any],
        close_engine: Callable[[Any], None],
        *,
        engine_retries: int = 1,
        torch_threads: int | None = None,
        on_finished: Callable[[list[RequestOutput]], None] | None = None,
    ) -> None:
        self.engine = engine
        self._on_finished = on_finished
        self._new_engine = new_engine
        self._close_engine = close_engine
        self._engine_retries = engine_retries
        self._torch_threads = torch_threads
        self._inbox: queue.SimpleQueue[_Shard] = queue.SimpleQueue()
        self._active: dict[str, _Shard] = {}  # request id -> its shard
        self._shards: list[_Shard] = []  # in the engine now, in submission order
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # starts the thread once
        # time.time() of the first step's start and the latest step's end (pipeline/job/phases.py)
        self.first_step_at: float | None = None
        self.last_step_at: float | None = None
        if engine is None:  # built in the feed thread (see the module's docstring)
            self._built: Future[None] = Future()
            self._start()
            self._built.result()  # the engine's construction error, raised here

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="engine-feed", daemon=True)
                self._thread.start()

    def submit(
        self, shard_id: str, prompts: Sequence, params: Sequence[SamplingParams], groups: list
    ) -> Future:
        """Queue a shard; the future gives its outputs in prompt order, `n` per prompt one
        after the other (or the engine's error)."""
        shard = _Shard(shard_id, list(prompts), list(params), list(groups))
        self._start()
        self._inbox.put(shard)
        return shard.future

    def generate(
        self, shard_id: str, prompts: Sequence, params: Sequence[SamplingParams], groups: list
    ) -> list[RequestOutput]:
        """`submit` and wait for the shard's outputs."""
        return self.submit(shard_id, prompts, params, groups).result()

    # ---- the feed thread --------------------------------------------------------------------

    def _run(self) -> None:
        # The engine actor's start: torch, transformers' modeling and the model (the stage's
        # module leaves them to this thread) with the cyclic collector paused (actors/gc_pause.py).
        with gc_paused():
            import torch

            if self._torch_threads:
                torch.set_num_threads(self._torch_threads)
            logger.debug("engine feed thread started (%d torch threads)", torch.get_num_threads())
            if self.engine is None:
                try:
                    self.engine = self._new_engine()
                except BaseException as exc:  # noqa: BLE001 (raised in __init__'s thread)
                    self._built.set_exception(exc)
                    return
                freeze_heap()  # the actor keeps this heap for its life (actors/gc_pause.py)
                self._built.set_result(None)
        while True:
            # Block only when the engine has nothing to do; otherwise take what has arrived.
            block = not self._shards
            while True:
                try:
                    shard = self._inbox.get(block=block)
                except queue.Empty:
                    break
                self._admit(shard)
                block = False
            if self._shards:
                self._step()

    def _admit(self, shard: _Shard) -> None:
        shard.attempts += 1
        shard.results.clear()
        shard.num_results = 0
        try:
            shard.request_ids = self.engine.add_prompts(shard.prompts, shard.params, shard.groups)
        except Exception as exc:  # noqa: BLE001 (the shard's rows carry the error)
            shard.future.set_exception(exc)
            return
        shard.num_samples = {
            rid: p.n for rid, p in zip(shard.request_ids, shard.params, strict=True)
        }
        self._shards.append(shard)
        for rid in shard.request_ids:
            self._active[rid] = shard

    def _step(self) -> None:
        if self.first_step_at is None:
            self.first_step_at = time.time()
        try:
            outputs = self.engine.step()
        except WorkerFailedError as exc:
            self._restart(exc)
            return
        except Exception as exc:  # noqa: BLE001 (an engine bug must not lose other shards' work)
            logger.exception("the engine failed; the rows of the shards in it get an error")
            self._fail_all(exc)
            return
        self.last_step_at = time.time()
        for out in outputs:
            if not out.finished:
                continue
            shard = self._active.get(out.request_id)
            if shard is None:
                continue
            samples = shard.results.setdefault(out.request_id, {})
            samples[out.sample_index] = out
            shard.num_results += 1
            if len(samples) == shard.num_samples[out.request_id]:
                del self._active[out.request_id]
                if self._on_finished is not None:
                    self._on_finished(list(samples.values()))
            if shard.num_results == shard.expected():
                self._shards.remove(shard)
                shard.future.set_result(shard.outputs())

    def _restart(self, exc: WorkerFailedError) -> None:
        """A fresh engine; every shard that was in the failed one is queued again."""
        shards, self._shards, self._active = self._shards, [], {}
        self._close_engine(self.engine)
        redo = []
        for shard in shards:
            if shard.attempts > self._engine_retries:
                shard.future.set_exception(
                    WorkerFailedError(
                        f"shard {shard.shard_id}: the parallel engine failed {shard.attempts} "
                        f"times (engine_retries={self._engine_retries}); last: {exc}"
                    )
                )
            else:
                logger.warning(
                    "shard %s: %s; redoing it on a fresh engine (retry %d of %d)",
                    shard.shard_id,
                    exc,
                    shard.attempts,
                    self._engine_retries,
                )
                redo.append(shard)
        if not redo:
            return
        try:
            self.engine = self._new_engine()
        except Exception as build_exc:  # noqa: BLE001 (the waiting shards carry the cause)
            for shard in redo:
                shard.future.set_exception(build_exc)
            return
        freeze_heap()  # thaws first: the failed engine's cycles are collected
        for shard in redo:
            self._admit(shard)

    def _fail_all(self, exc: Exception) -> None:
        shards, self._shards, self._active = self._shards, [], {}
        for shard in shards:
            for rid in shard.request_ids:
                try:
                    self.engine.abort_request(rid)
                except Exception:  # noqa: BLE001 (best effort: the engine already failed)
                    logger.debug("could not abort %s", rid, exc_info=True)
            shard.future.set_exception(exc)
