"""The step loop survives one request's failure (a planted fault) and its neighbours finish.

A small scripted engine (no Ray, no torch): the loop is the part under test, the engine only
plays its part and raises where a test plants a fault.
"""

from __future__ import annotations

import asyncio
import time

from actors.config import SamplingParams
from actors.outputs import RequestOutput
from packing.admission import AdmissionConfig
from pipeline.serve.staging import EngineFailedError, EngineLoop


class PlantedEngine:
    """One token per running request per step; `add_request` raises for prompt [666]."""

    def __init__(self) -> None:
        self.running: dict[str, tuple[int, list[int]]] = {}

    def add_request(self, prompt, params=None, request_id=None) -> str:  # noqa: ANN001
        if list(prompt) == [666]:
            raise RuntimeError("Overflow when unpacking long long")  # as torch's manual_seed
        self.running[request_id] = (params.max_tokens, [])
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.running.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> list[RequestOutput]:
        time.sleep(0.002)
        outputs = []
        for request_id, (max_tokens, tokens) in list(self.running.items()):
            tokens.append(len(tokens) + 1)
            done = len(tokens) >= max_tokens
            outputs.append(
                RequestOutput(
                    request_id=request_id,
                    num_prompt_tokens=1,
                    token_ids=tuple(tokens),
                    text="x" * len(tokens),
                    finished=done,
                    finish_reason="length" if done else None,
                )
            )
            if done:
                del self.running[request_id]
        return outputs


async def last(stream) -> RequestOutput:  # noqa: ANN001
    final = None
    async for output in stream:
        final = output
    assert final is not None
    return final


def test_a_failing_admission_fails_that_request_alone() -> None:
    async def main() -> None:
        loop = EngineLoop(PlantedEngine(), AdmissionConfig(policy="immediate"), max_waiting=16)
        loop.start()
        before = [loop.submit([1], SamplingParams(max_tokens=20)) for _ in range(3)]
        await asyncio.sleep(0.01)  # the neighbours are running when the bad one arrives
        bad = loop.submit([666], SamplingParams(max_tokens=5))
        after = [loop.submit([2], SamplingParams(max_tokens=4)) for _ in range(2)]
        results = await asyncio.gather(
            *(last(s) for s in [*before, bad, *after]), return_exceptions=True
        )
        assert isinstance(results[3], EngineFailedError)
        assert "Overflow" in str(results[3])
        finished = [r for i, r in enumerate(results) if i != 3]
        assert all(isinstance(r, RequestOutput) and r.finished for r in finished), results
        assert [len(r.token_ids) for r in finished] == [20, 20, 20, 4, 4]
        assert loop.alive and loop.num_running == 0 and loop.num_waiting == 0
        await loop.stop()

    asyncio.run(asyncio.wait_for(main(), timeout=20))


def test_the_loop_outlives_a_failure_outside_the_engine() -> None:
    """A fault in the loop's own bookkeeping fails the running requests, never the loop."""

    class BrokenOnce(PlantedEngine):
        def __init__(self) -> None:
            super().__init__()
            self.broken = True

        def has_unfinished(self) -> bool:
            if self.broken and self.running:
                self.broken = False
                raise ValueError("planted")
            return super().has_unfinished()

    async def main() -> None:
        loop = EngineLoop(BrokenOnce(), AdmissionConfig(policy="immediate"), max_waiting=16)
        loop.start()
        first = loop.submit([1], SamplingParams(max_tokens=3))
        try:
            await last(first)
            raise AssertionError("the planted failure did not reach the running request")
        except EngineFailedError:
            pass
        assert loop.alive
        second = await last(loop.submit([1], SamplingParams(max_tokens=3)))
        assert second.finished and len(second.token_ids) == 3
        await loop.stop()

    asyncio.run(asyncio.wait_for(main(), timeout=20))
