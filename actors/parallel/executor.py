"""The engine's runner when tp x pp > 1: worker actors in one placement group.

Workers are laid out stage-major (bundle `stage * tp + rank`). Each step's plan is put in
Ray's object store once and handed to every worker; stage s+1 receives stage s's hidden
states (tp rank 0's result) directly from the object store, so the driver only sees the last
stage's logits. `submit` returns at once, so several steps can be in flight (see
`actors.parallel.pipelined`); `collect` waits for one, and any worker that dies or fails
makes it raise `WorkerFailedError` after tearing the group down (no hang in a collective).

An engine whose actor already runs in a placement group (one group per engine actor, as
pipeline/job/run.py and Ray's LLM layer give them) puts its workers in that group's bundles,
worker i in bundle i, the engine actor itself beside worker 0 in bundle 0, and leaves the
group to its owner on shutdown. Otherwise it reserves a group of its own and removes it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.config import EngineConfig
from actors.parallel import placement
from actors.parallel.errors import WorkerFailedError
from actors.parallel.step_plan import plan_step
from actors.parallel.worker import StageWorker
from actors.request import Request
from actors.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepHandle:
    """A submitted step: its sampling requests and the results still to come."""

    step: int
    sampling: list[Request]
    logits: ray.ObjectRef[Any]  # the last stage's tp rank 0
    watched: tuple[tuple[ray.ObjectRef[Any], str], ...]  # every result that can report a failure


class ParallelExecutor:
    """`submit` / `collect` / `execute` / `copy_blocks` like `ModelRunner` (the engine's
    `StepRunner`), over tp x pp worker actors; up to pp steps in flight."""

    root_cause_grace_s = 5.0  # how long a failed step waits for a peer's death to surface

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        dtype: torch.dtype = torch.float32,
        placement_timeout_s: float = 60.0,
        step_timeout_s: float = 300.0,
        rope: bool = False,
    ) -> None:
        self.config = config
        self.rope = rope  # the model's rope depends on the length (actors/rope.py)
        self.tp, self.pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.max_in_flight = self.pp  # one step per stage (and per request set) at once
        self.step_timeout_s = step_timeout_s
        self._step = 0
        self._closed = False
        self.failure: str | None = None  # the first failure's message, once one happened
        if not ray.is_initialized():
            ray.init()
        device = placement.worker_device(config)
        bundles = placement.worker_bundles(
            config.world_size, config.worker_num_cpus, device.startswith("cuda")
        )
        self.pg, self.owns_placement_group = self._placement_group(bundles, placement_timeout_s)
        remote = ray.remote(StageWorker)
        self.workers: list[list[Any]] = [
            [
                remote.options(
                    num_cpus=bundles[0]["CPU"],
                    num_gpus=bundles[0].get("GPU", 0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.pg, placement_group_bundle_index=stage * self.tp + rank
                    ),
                ).remote(config, stage, rank, num_blocks, device)
                for rank in range(self.tp)
            ]
            for stage in range(self.pp)
        ]
        try:
            self._start(str(dtype).removeprefix("torch."), placement_timeout_s)
        except Exception:
            self.shutdown()
            raise

    def _placement_group(
        self, bundles: list[placement.Bundle], timeout_s: float
    ) -> tuple[PlacementGroup, bool]:
        """The engine actor's own placement group when it runs in one (worker i in bundle i;
        the caller keeps it), else a new group of `bundles` that this engine owns."""
        current = get_current_placement_group()
        if current is None:
            strategy = "STRICT_PACK" if self.pp == 1 else self.config.placement_strategy
            return placement.reserve(bundles, strategy, timeout_s), True
        problem = placement.check_holds(current.bundle_specs, bundles)
        if problem is not None:
            raise ValueError(
                f"this engine runs in placement group {current.id.hex()} but cannot place its "
                f"tp={self.tp} x pp={self.pp} workers there: {problem}"
            )
        logger.info("parallel engine uses its actor's placement group %s", current.id.hex())
        return current, False

    def _start(self, dtype: str, timeout_s: float) -> None:
        if self.tp > 1:
            addresses = ray.get([s[0].address.remote() for s in self.workers], timeout=timeout_s)
            ray.get(
                [
                    w.init_group.remote(host, port, timeout_s)
                    for stage, (host, port) in zip(self.workers, addresses, strict=True)
                    for w in stage
                ],
                timeout=timeout_s,
            )
        ranges = ray.get([w.load.remote(dtype) for s in self.workers for w in s], timeout=timeout_s)
        logger.info("parallel engine ready: tp=%d pp=%d, layers %s", self.tp, self.pp, ranges)

    @property
    def all_workers(self) -> list[Any]:
        """Workers stage-major."""
        return [w for stage in self.workers for w in stage]

    def submit(self, sched: SchedulerOutput, block_offset: int = 0) -> StepHandle:
        """Send one step to the workers without waiting (block ids shifted by
        `block_offset`: a virtual engine's slice of the KV pool)."""
        if self._closed:
            raise self.closed_error()
        self._step += 1
        plan, sampling = plan_step(
            sched, self.config.block_size, self._step, block_offset, self.rope
        )
        plan_ref = ray.put(plan)  # broadcast once: every worker reads the same object
        hidden: Any = None
        watched: list[tuple[ray.ObjectRef[Any], str]] = []
        for s, stage in enumerate(self.workers):
            refs = [w.execute.remote(plan_ref, hidden) for w in stage]
            hidden = refs[0]
            # Stage s's rank 0 result feeds stage s+1, whose task fails if it failed.
            start = 0 if s == self.pp - 1 else 1
            watched += [(refs[r], f"stage {s} tp rank {r}") for r in range(start, self.tp)]
        return StepHandle(self._step, sampling, hidden, tuple(watched))

    def collect(self, handle: StepHandle) -> tuple[list[Request], torch.Tensor]:
        """Wait for a submitted step; its sampling requests and their logits."""
        names = {ref: name for ref, name in handle.watched}
        pending = list(names)
        deadline = time.monotonic() + self.step_timeout_s
        while pending:
            ready, pending = ray.wait(
                pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                self._fail(f"step {handle.step} did not finish within {self.step_timeout_s:g} s")
            for ref in ready:
                try:
                    ray.get(ref)
                except (ray.exceptions.RayError, RuntimeError) as error:
                    failed, cause = self._root_cause(ref, error, pending)
                    self._fail(f"{names[failed]} failed in step {handle.step}: {cause}", cause)
        logits = ray.get(handle.logits)
        return handle.sampling, logits

    def _root_cause(
        self, ref: ray.ObjectRef[Any], error: BaseException, pending: list[ray.ObjectRef[Any]]
    ) -> tuple[ray.ObjectRef[Any], BaseException]:
        """The failure to report when one worker's step failed: a worker whose process died
        is the cause, and its peers' errors (a collective cut off by the dead peer, e.g.
        gloo's 'Connection closed by peer') are consequences. Which of them Ray reports first
        is a race, so the still-pending steps get a short grace to report a dead process."""
        if isinstance(error, ray.exceptions.ActorDiedError) or not pending:
            return ref, error
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=self.root_cause_grace_s)
        for other in ready:
            try:
                ray.get(other)
            except ray.exceptions.ActorDiedError as died:
                return other, died
            except (ray.exceptions.RayError, RuntimeError):
                continue
        return ref, error

    def execute(self, sched: SchedulerOutput) -> tuple[list[Request], torch.Tensor]:
        """Run one step to completion (the engine's synchronous path)."""
        return self.collect(self.submit(sched))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks on every worker (steps also carry their copies in the plan)."""
        ray.get([w.copy_blocks.remote(copies) for w in self.all_workers])

    def take_timings(self) -> list[list[tuple[int, float, float]]]:
        """Per stage, tp rank 0's (step, start, end) since the last call."""
        return ray.get([stage[0].take_timings.remote() for stage in self.workers])

    def closed_error(self) -> WorkerFailedError:
        """The error for a step asked of a shut-down engine: it names the first failure (a
        caller's queued work reaches the engine after it failed, and should say why)."""
        why = f": {self.failure}" if self.failure else ""
        return WorkerFailedError(f"this parallel engine was shut down after a failure{why}")

    def _fail(self, message: str, cause: BaseException | None = None) -> None:
        if self.failure is not None:  # already failed: a dead peer is not the cause
            raise self.closed_error() from cause
        self.failure = f"tensor/pipeline parallel engine (tp={self.tp}, pp={self.pp}): {message}"
        logger.error("parallel engine failed: %s", message)
        self.shutdown()  # survivors may be blocked in a collective with a dead peer
        raise WorkerFailedError(self.failure) from cause

    def shutdown(self) -> None:
        """Kill the workers and release the placement group if this engine reserved it (a
        group it was started in belongs to its caller); idempotent."""
        if self._closed:
            return
        self._closed = True
        for worker in self.all_workers:
            ray.kill(worker, no_restart=True)
        if self.owns_placement_group:
            remove_placement_group(self.pg)

    def __del__(self) -> None:
        try:
            if ray.is_initialized():
                self.shutdown()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass
