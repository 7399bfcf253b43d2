"""A tensor/pipeline-parallel engine's executor, chosen once: Ray tasks or a compiled graph.

With pp > 1 the engine keeps `pp` steps in flight (one per request set,
`actors.virtual_schedulers`): while stage 1 runs set A's step, stage 0 runs set B's. Equal
token budgets (Sarathi: chunked prefill, decodes first) keep consecutive steps the same size,
which is what keeps the stages from waiting on each other; `bubble_fraction` measures how much
they still do.
"""

from __future__ import annotations

import logging

import torch

from actors.config import EngineConfig
from actors.parallel.compiled import CompiledSteps
from actors.parallel.executor import ParallelExecutor

logger = logging.getLogger(__name__)


def start_executor(
    config: EngineConfig,
    num_blocks: int,
    dtype: torch.dtype,
    compiled_graph: bool | None,
    rope: bool = False,
) -> ParallelExecutor | CompiledSteps:
    """Start the workers; with pp > 1 steps go through a Ray compiled graph over them when
    `compiled_graph` is True, or (None, the default) when every worker is a GPU on the
    engine's node. The graph's channel readers poll (the driver burned 80% of a core waiting
    for a result, an idle worker 25%): a host core per GPU affords that; a CPU engine pays
    with the cores its stages compute on (benchmarks/bench_parallel.py, SmolLM2 pp=2 on 2
    cores: 30% slower per step with 4-token decode steps, 6% faster with 128-token steps)."""
    if compiled_graph and config.pipeline_parallel_size == 1:
        raise ValueError("compiled_graph needs pipeline_parallel_size > 1")
    executor = ParallelExecutor(config, num_blocks, dtype, rope=rope)
    if config.pipeline_parallel_size == 1 or compiled_graph is False:
        return executor
    try:
        where = _worker_places(executor)
        if compiled_graph is None:
            compiled_graph = where == {"this node cuda"}
        if compiled_graph and any(w.startswith("other node") for w in where):
            # Shared-memory channels are what we measured; across (simulated) nodes the
            # graph's channel reads timed out in our two-node test: keep Ray tasks there.
            logger.info("pp workers span several nodes: one Ray task per worker per step")
            compiled_graph = False
        if compiled_graph:
            return CompiledSteps(executor, max_in_flight=config.pipeline_parallel_size)
    except Exception:
        executor.shutdown()
        raise
    return executor


def _worker_places(executor: ParallelExecutor) -> set[str]:
    """Where the workers are: "this node cuda", "other node cpu", ..."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    workers = executor.all_workers
    nodes = ray.get([w.node_id.remote() for w in workers], timeout=60)
    devices = ray.get([w.device_type.remote() for w in workers], timeout=60)
    return {
        f"{'this' if node == here else 'other'} node {device}"
        for node, device in zip(nodes, devices, strict=True)
    }


def bubble_fraction(timings: list[list[tuple[int, float, float]]]) -> float:
    """Idle share of the stages between the first step's start and the last step's end:
    `1 - busy / (stages * span)` from each stage's (step, start, end) records."""
    spans = [(start, end) for stage in timings for _, start, end in stage]
    if not spans:
        return 0.0
    span = max(e for _, e in spans) - min(s for s, _ in spans)
    busy = sum(e - s for s, e in spans)
    return max(0.0, 1.0 - busy / (len(timings) * span)) if span > 0 else 0.0
