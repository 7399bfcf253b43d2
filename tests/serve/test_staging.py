"""The staging queue and step loop against a scripted fake engine (no Ray, no torch)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from actors.config import SamplingParams
from actors.outputs import RequestOutput
from packing.admission import AdmissionConfig
from pipeline.serve.staging import EngineFailedError, EngineLoop, QueueFullError, step_thread


class FakeEngine:
    """Emits one token (the step number) per running request per step; records what it saw."""

    def __init__(
        self,
        step_s: float = 0.002,
        fail_on_step: int | None = None,
        gate: threading.Event | None = None,
    ) -> None:
        self.running: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.admitted_groups: list[list[str]] = []
        self.aborted: list[str] = []
        self.steps = 0
        self.step_s = step_s
        self.fail_on_step = fail_on_step
        self.gate = gate  # when set, each step waits for it (the test holds the engine busy)
        self._group: list[str] = []

    def add_request(self, prompt, params=None, request_id=None) -> str:  # noqa: ANN001
        self.running[request_id] = (list(prompt), params, [])
        self._group.append(request_id)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.running.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> list[RequestOutput]:
        if self._group:
            self.admitted_groups.append(self._group)
            self._group = []
        self.steps += 1
        if self.fail_on_step == self.steps:
            raise RuntimeError("boom")
        if self.gate is not None:
            assert self.gate.wait(timeout=20), "the test never released the engine"
        time.sleep(self.step_s)
        outputs = []
        for request_id, (prompt, params, tokens) in list(self.running.items()):
            tokens.append(self.steps)
            done = len(tokens) >= params.max_tokens
            outputs.append(
                RequestOutput(
                    request_id=request_id,
                    num_prompt_tokens=len(prompt),
                    token_ids=tuple(tokens),
                    text="".join(f"<{t}>" for t in tokens),
                    finished=done,
                    finish_reason="length" if done else None,
                )
            )
            if done:
                del self.running[request_id]
        return outputs


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Wait for a condition, polling; the timeout only guards against a hang."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def collect(stream) -> list[RequestOutput]:  # noqa: ANN001
    return [out async for out in stream]


def test_requests_stream_cumulative_outputs_and_finish() -> None:
    async def main() -> None:
        engine = FakeEngine()
        loop = EngineLoop(engine, AdmissionConfig(policy="immediate"), max_waiting=8)
        loop.start()
        streams = [loop.submit([1, 2, 3], SamplingParams(max_tokens=n)) for n in (1, 3)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        assert [r[-1].finish_reason for r in results] == ["length", "length"]
        assert [len(r[-1].token_ids) for r in results] == [1, 3]
        assert all(out.finished == (i == len(r) - 1) for r in results for i, out in enumerate(r))
        assert loop.num_running == loop.num_waiting == 0
        await loop.stop()

    run(main())


def test_steps_run_in_the_thread_that_built_the_engine() -> None:
    """A replica builds its engine in the step thread and hands it to the loop (one thread
    runs all of the engine's torch work: pipeline/serve/staging.py `step_thread`)."""

    async def main() -> None:
        thread = step_thread()
        engine = thread.submit(FakeEngine).result()
        builder = thread.submit(threading.current_thread).result()
        steppers: set[threading.Thread] = set()
        step = engine.step

        def traced() -> list[RequestOutput]:
            steppers.add(threading.current_thread())
            return step()

        engine.step = traced  # type: ignore[method-assign]
        loop = EngineLoop(
            engine, AdmissionConfig(policy="immediate"), max_waiting=8, executor=thread
        )
        loop.start()
        result = await collect(loop.submit([1, 2], SamplingParams(max_tokens=3)))
        assert len(result[-1].token_ids) == 3
        await loop.stop()
        assert steppers == {builder}

    run(main())


def test_fixed_window_admits_one_packed_group() -> None:
    async def main() -> None:
        engine = FakeEngine()
        config = AdmissionConfig(policy="fixed", window_requests=3, window_s=10.0)
        loop = EngineLoop(engine, config, max_waiting=8)
        loop.start()
        params = SamplingParams(max_tokens=2)
        first = [loop.submit([i], params) for i in range(2)]
        await asyncio.sleep(0.05)
        assert loop.num_waiting == 2 and engine.steps == 0  # window not full: nobody admitted
        third = loop.submit([9], params)
        await asyncio.gather(*(collect(s) for s in [*first, third]))
        assert [len(g) for g in engine.admitted_groups] == [3]
        await loop.stop()

    run(main())


def test_fixed_window_times_out() -> None:
    """A window that never fills admits its requests once window_s has passed on the loop's
    clock, not before: a test clock, so no wall-clock duration is measured."""

    async def main() -> None:
        now = [100.0]
        engine = FakeEngine()
        config = AdmissionConfig(policy="fixed", window_requests=100, window_s=0.05)
        loop = EngineLoop(engine, config, max_waiting=8, clock=lambda: now[0])
        loop.start()
        done = asyncio.ensure_future(collect(loop.submit([1], SamplingParams(max_tokens=1))))
        for _ in range(5):  # several wake-ups of the loop (its timer is real time)
            await asyncio.sleep(0.05)
            assert loop.num_waiting == 1 and engine.steps == 0, "admitted before the window"
        now[0] += 0.05
        outputs = await done
        assert outputs[-1].finished and engine.admitted_groups == [["srv-0"]]
        await loop.stop()

    run(main())


def test_queue_full_raises() -> None:
    async def main() -> None:
        config = AdmissionConfig(policy="fixed", window_requests=100, window_s=60.0)
        loop = EngineLoop(FakeEngine(), config, max_waiting=2)
        loop.start()
        loop.submit([1], SamplingParams())
        loop.submit([2], SamplingParams())
        with pytest.raises(QueueFullError):
            loop.submit([3], SamplingParams())
        await loop.stop()

    run(main())


def test_leaving_a_stream_aborts_in_staging_and_in_engine() -> None:
    async def main() -> None:
        engine = FakeEngine(step_s=0.005)
        loop = EngineLoop(engine, AdmissionConfig(policy="immediate"), max_waiting=8)
        loop.start()
        stream = loop.submit([1], SamplingParams(max_tokens=1000))
        async for out in stream:
            if len(out.token_ids) >= 2:
                break
        await until(lambda: engine.aborted == [stream.request_id], "the engine abort")
        assert loop.num_running == 0 and not engine.running and loop.num_aborted == 1

        # a request still in the staging queue is just dropped
        held = EngineLoop(
            FakeEngine(), AdmissionConfig(policy="fixed", window_s=60.0), max_waiting=8
        )
        held.start()
        waiting = held.submit([1], SamplingParams())
        task = asyncio.ensure_future(collect(waiting))
        # One loop turn runs the new task up to its first wait (asyncio runs ready tasks in
        # order): deterministic, no wall-clock race.
        await asyncio.sleep(0)
        assert held.num_waiting == 1 and not task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert held.num_waiting == 0 and held.num_aborted == 1
        await asyncio.gather(loop.stop(), held.stop())

    run(main())


def test_engine_failure_fails_running_requests_and_loop_survives() -> None:
    async def main() -> None:
        engine = FakeEngine(fail_on_step=2)
        loop = EngineLoop(engine, AdmissionConfig(policy="immediate"), max_waiting=8)
        loop.start()
        with pytest.raises(EngineFailedError):
            await collect(loop.submit([1], SamplingParams(max_tokens=5)))
        result = await collect(loop.submit([2], SamplingParams(max_tokens=2)))
        assert result[-1].finished and loop.alive
        await loop.stop()

    run(main())


def test_ttfts_feed_the_controller() -> None:
    async def main() -> None:
        config = AdmissionConfig(policy="aimd", ttft_low_s=10.0, ttft_high_s=20.0, max_wait_s=0.01)
        loop = EngineLoop(FakeEngine(), config, max_waiting=8)
        loop.start()
        for _ in range(3):
            await collect(loop.submit([1], SamplingParams(max_tokens=1)))
        assert loop.controller.threshold == 1 + 3  # slack: N_t grew by alpha per observation
        assert loop.controller.smoothed_p95_ttft is not None
        await loop.stop()

    run(main())


def test_engine_capacity_keeps_the_rest_in_staging() -> None:
    async def main() -> None:
        gate = threading.Event()  # the engine's first step waits: the state below holds still
        engine = FakeEngine(gate=gate)
        loop = EngineLoop(engine, AdmissionConfig(policy="immediate"), max_waiting=3, max_running=2)
        loop.start()
        params = SamplingParams(max_tokens=3)
        streams = [loop.submit([i], params) for i in range(3)]
        await until(lambda: engine.steps == 1, "the first step")
        assert (loop.num_running, loop.num_waiting) == (2, 1)  # two in the engine, one staged
        streams += [loop.submit([i], params) for i in range(2)]
        with pytest.raises(QueueFullError):  # the staging queue is the bound, whatever the policy
            loop.submit([9], params)
        gate.set()
        await asyncio.gather(*(collect(s) for s in streams))
        assert max(len(g) for g in engine.admitted_groups) <= 2
        await loop.stop()

    run(main())
