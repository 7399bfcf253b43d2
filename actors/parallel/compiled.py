"""A parallel engine's steps through a Ray compiled graph (`ray.dag`), not one task per worker.

The classic path (`ParallelExecutor.submit`) costs a `ray.put` of the plan and one actor task
per worker per step, and stage s+1's task reaches its worker only after the driver learns
that stage s's hidden states exist: about 1 ms a task on an idle machine and 10-20 ms on this
shared 2-core one, paid on the pipeline's critical path. A compiled graph is built once over
the same workers: each step's plan is written once into a shared-memory channel that every
worker reads, hidden states go stage to stage through channels without the driver, and the
driver reads only the outputs (Ray documents < 50 us of system overhead per execution).
Several executions may be in flight, which is what `actors.parallel.pipelined` needs.

Failures keep the executor's contract: any worker that raises or dies makes `collect` raise
`WorkerFailedError` naming the worker and the step, after the workers are killed and the
placement group released (so no survivor hangs in a collective).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.dag import InputNode, MultiOutputNode

from actors.parallel.errors import WorkerFailedError
from actors.parallel.executor import ParallelExecutor
from actors.parallel.step_plan import plan_step
from actors.request import Request
from actors.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompiledStep:
    """A submitted step: its sampling requests and the graph's outputs still to come."""

    step: int
    sampling: list[Request]
    outputs: list[Any]  # CompiledDAGRef per graph output; [0] is the logits


class CompiledSteps:
    """`submit` / `collect` / `execute` of a `ParallelExecutor`'s steps as one compiled graph
    over its workers (the executor still owns the workers and the placement group)."""

    def __init__(self, executor: ParallelExecutor, max_in_flight: int) -> None:
        self.executor = executor
        self.max_in_flight = max_in_flight
        self.step_timeout_s = executor.step_timeout_s
        self._names: list[str] = []  # of each graph output
        self._actors: dict[str, str] = {}  # actor id (hex) -> "stage s tp rank r"
        with InputNode() as plan:
            hidden: Any = None
            outputs: list[Any] = []
            last = len(executor.workers) - 1
            for s, stage in enumerate(executor.workers):
                nodes = [w.execute.bind(plan, hidden) for w in stage]
                hidden = nodes[0]  # stage s's tp rank 0 feeds stage s+1
                for r, (worker, node) in enumerate(zip(stage, nodes, strict=True)):
                    name = f"stage {s} tp rank {r}"
                    self._actors[worker._actor_id.hex()] = name
                    if r > 0 or s == last:  # every leaf is an output (and reports failures)
                        outputs.append((node, name))
            outputs.sort(key=lambda o: o[1] != f"stage {last} tp rank 0")  # logits first
            self._names = [name for _, name in outputs]
            dag = MultiOutputNode([node for node, _ in outputs])
        self.graph = dag.experimental_compile(
            _max_inflight_executions=max_in_flight, _submit_timeout=self.step_timeout_s
        )

    def __getattr__(self, name: str) -> Any:
        """Everything else (workers, pg, take_timings, the step counter) is the executor's:
        this object stands in for it as the engine's runner."""
        if name == "executor":  # not set yet (a failed __init__)
            raise AttributeError(name)
        return getattr(self.executor, name)

    def submit(self, sched: SchedulerOutput, block_offset: int = 0) -> CompiledStep:
        """Write one step's plan into the graph without waiting."""
        if self.executor._closed:
            raise self.executor.closed_error()
        self.executor._step += 1  # one counter with the classic path (fault injection reads it)
        step = self.executor._step
        plan, sampling = plan_step(
            sched, self.executor.config.block_size, step, block_offset, self.executor.rope
        )
        try:
            outputs = self.graph.execute(plan)
        except (ray.exceptions.RayError, RuntimeError) as error:
            self._fail(f"step {step} could not be submitted: {error}", error)
        return CompiledStep(step, sampling, list(outputs))

    def collect(self, handle: CompiledStep) -> tuple[list[Request], torch.Tensor]:
        """Wait for a submitted step; its sampling requests and their logits."""
        values = []
        for ref, name in zip(handle.outputs, self._names, strict=True):
            try:
                values.append(ref.get(timeout=self.step_timeout_s))
            except ray.exceptions.RayChannelTimeoutError as error:
                self._fail(
                    f"step {handle.step} did not finish within {self.step_timeout_s:g} s", error
                )
            except (ray.exceptions.RayError, RuntimeError) as error:
                self._fail(f"{self._culprit(error, name)} failed in step {handle.step}: {error}")
        return handle.sampling, values[0]

    def execute(self, sched: SchedulerOutput) -> tuple[list[Request], torch.Tensor]:
        """Run one step to completion."""
        return self.collect(self.submit(sched))

    def _culprit(self, error: BaseException, output: str) -> str:
        """The worker an error came from (an error travels down the graph to later outputs)."""
        actor_id = getattr(error, "actor_id", None) or getattr(error, "_actor_id", None)
        return self._actors.get(str(actor_id), output)

    def _fail(self, message: str, cause: BaseException | None = None) -> None:
        if self.executor.failure is not None:  # already failed: a dead peer is not the cause
            raise self.executor.closed_error() from cause
        executor = self.executor
        executor.failure = (
            f"tensor/pipeline parallel engine (tp={executor.tp}, pp={executor.pp}): {message}"
        )
        logger.error("parallel engine failed: %s", message)
        closed = executor._closed
        executor.shutdown()  # kill first: a survivor may wait in a collective forever
        if not closed:
            self._teardown()
        raise WorkerFailedError(executor.failure) from cause

    def shutdown(self) -> None:
        """Stop the graph's loops on the workers, then kill them and release the group."""
        if not self.executor._closed:
            self._teardown()
        self.executor.shutdown()

    def _teardown(self) -> None:
        try:
            self.graph.teardown()
        except Exception as error:  # noqa: BLE001 (dead workers: nothing left to stop)
            logger.debug("compiled graph teardown: %s", error)
