"""The Ray actor in one placement-group bundle: one (stage, tp rank) of a parallel engine.

It owns its stage's weights (only its shard) and the KV tensors of its layers and KV heads,
and runs each step's `StepPlan`: the first stage embeds token ids, later stages take the
previous stage's hidden states (a Ray object passed straight from actor to actor), the last
stage returns logits of the sampling rows. Only tp rank 0 returns anything; the other ranks
return None after taking part in the all-reduces.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time

from actors.config import EngineConfig
from actors.gc_pause import freeze_heap, gc_paused

# Ray imports this module as the worker's class arrives: its start (actors/gc_pause.py).
with gc_paused():
    import numpy as np
    import torch
    import torch.distributed as dist

    from actors import attention
    from actors.kv_cache import allocate_kv_tensors
    from actors.parallel.step_plan import StepPlan
    from actors.parallel.weights import build_stage

logger = logging.getLogger(__name__)


class StageWorker:
    """One worker process (wrapped with `ray.remote` by the executor)."""

    def __init__(
        self, config: EngineConfig, stage: int, tp_rank: int, num_blocks: int, device: str
    ) -> None:
        self.config = config
        self.stage_index = stage
        self.tp_rank = tp_rank
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.busy: list[tuple[int, float, float]] = []  # (step, start, end), monotonic clock
        self.busy_cpu: list[tuple[int, float]] = []  # (step, CPU seconds of the stepping thread)
        self._crash_at_step: int | None = None
        torch.set_num_threads(max(1, int(config.worker_num_cpus)))

    def address(self) -> tuple[str, int]:
        """This node's IP and a free TCP port on it (tp rank 0 hosts the group's store)."""
        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = int(sock.getsockname()[1])
        ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return ip, port

    def init_group(self, host: str, port: int, timeout_s: float) -> None:
        """Join this stage's tensor-parallel group (gloo on CPU, nccl on CUDA)."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{port}",
            rank=self.tp_rank,
            world_size=self.config.tensor_parallel_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    def load(self, dtype: str) -> tuple[int, int]:
        """Build the stage and its KV tensors; returns its layer range."""
        with gc_paused():  # the worker's start (actors/gc_pause.py)
            self.stage, shape, (start, stop) = build_stage(
                self.config, getattr(torch, dtype), self.device, self.stage_index, self.tp_rank
            )
        owned = allocate_kv_tensors(
            stop - start,
            self.num_blocks,
            self.config.block_size,
            shape.local_kv_heads,
            shape.head_dim,
            getattr(torch, dtype),
            self.device,
        )
        # attention.paged_attention indexes by the global layer_idx: other layers get nothing.
        empty = torch.empty(0, device=self.device)
        self.kv_caches = [(empty, empty)] * start + owned
        self.attention_backend = attention.make_backend(
            self.config.attention_backend,
            self.kv_caches,
            self.config.shared_prefix_attention,
            self.config.shared_prefix_min_keys,
        )
        freeze_heap()  # the worker keeps this heap for its life
        return start, stop

    def node_id(self) -> str:
        """The Ray node this worker runs on."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def device_type(self) -> str:
        """ "cuda" or "cpu"."""
        return self.device.type

    def crash_at_step(self, step: int) -> None:
        """Fault injection for tests: exit the process in the middle of step `step`."""
        self._crash_at_step = step

    def take_timings(self) -> list[tuple[int, float, float]]:
        """(step, start, end) of the steps run since the last call."""
        out, self.busy = self.busy, []
        return out

    def take_cpu_times(self) -> list[tuple[int, float]]:
        """(step, CPU seconds) of the steps run since the last call: against the busy span it
        shows how long a step was descheduled on a shared machine."""
        out, self.busy_cpu = self.busy_cpu, []
        return out

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every owned layer."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        with torch.inference_mode():
            for k_cache, v_cache in self.kv_caches:
                if k_cache.numel():
                    k_cache[dst] = k_cache[src]
                    v_cache[dst] = v_cache[src]

    def execute(self, plan: StepPlan, hidden: torch.Tensor | None) -> torch.Tensor | None:
        """Run this stage for one step: hidden states (or logits on the last stage) from tp
        rank 0, None from the others."""
        start, cpu = time.monotonic(), time.thread_time()
        self.copy_blocks(list(plan.block_copies))
        batch = attention.StepBatch(
            plan.num_cached,
            plan.num_new,
            [list(t) for t in plan.block_tables],
            plan.cu_seqlens_q,
            plan.num_decodes,
            self.config.block_size,
        )
        meta = attention.AttentionMetadata.build(self.attention_backend, batch, plan.slot_mapping)
        if self._crash_at_step == plan.step:
            logger.error("fault injection: worker exits in step %d", plan.step)
            os._exit(1)
        out: torch.Tensor = self.stage(
            _tensor(plan.input_ids, self.device)[None],
            _tensor(plan.positions, self.device)[None],
            None if hidden is None else hidden.to(self.device),
            _tensor(plan.logits_indices, self.device),
            meta,
            None if plan.rope_lens is None else _tensor(plan.rope_lens, self.device),
        )
        self.busy.append((plan.step, start, time.monotonic()))
        self.busy_cpu.append((plan.step, time.thread_time() - cpu))
        if self.tp_rank != 0:
            return None
        return out.cpu() if self.device.type != "cpu" else out


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    # Arrays from Ray's object store are read-only: copy rather than share their memory.
    return torch.tensor(array, device=device)
