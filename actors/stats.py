"""Step counters of one engine: a read-only snapshot for callers, a periodic summary log line.

`LLMEngine.stats` returns an `EngineStats` snapshot (benchmarks check, for example, that a
batch ran in exactly one step); `StepStats` is the engine's own mutable counter behind it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from actors.scheduler import SchedulerOutput
    from actors.virtual_schedulers import VirtualSchedulers

logger = logging.getLogger("actors.engine")

LOG_EVERY_STEPS = 100


@dataclass(frozen=True)
class EngineStats:
    """Totals since the engine was built."""

    num_steps: int  # steps that ran the model
    num_scheduled_tokens: int  # tokens computed by those steps (prefill chunks + decodes)
    step_seconds: float  # wall time inside those steps (model, sampling, bookkeeping)
    num_preemptions: int  # requests preempted (freed, to be recomputed)


class StepStats:
    """Counts steps and tokens; logs one summary line every `LOG_EVERY_STEPS` steps."""

    def __init__(self) -> None:
        self.steps = 0
        self.total_tokens = 0
        self.total_seconds = 0.0
        self._window_tokens = 0  # since the last summary line
        self._window_seconds = 0.0

    def record(self, sched: SchedulerOutput, seconds: float, sets: VirtualSchedulers) -> None:
        """Count one step that ran `sched` in `seconds` (`sets`: the engine's requests, for
        the summary line)."""
        tokens = sched.total_num_scheduled_tokens
        self.steps += 1
        self.total_tokens += tokens
        self.total_seconds += seconds
        self._window_tokens += tokens
        self._window_seconds += seconds
        if self.steps % LOG_EVERY_STEPS == 0:
            logger.info(
                "step %d: %.0f tokens/s over the last %d steps, running %d, waiting %d, "
                "KV usage %.0f%%, preemptions %d",
                self.steps,
                self._window_tokens / max(self._window_seconds, 1e-9),
                LOG_EVERY_STEPS,
                len(sets.running),
                len(sets.waiting),
                100 * sets.kv_usage,
                sets.num_preemptions,
            )
            self._window_tokens, self._window_seconds = 0, 0.0

    def snapshot(self, num_preemptions: int) -> EngineStats:
        """The totals as an immutable record."""
        return EngineStats(self.steps, self.total_tokens, self.total_seconds, num_preemptions)
