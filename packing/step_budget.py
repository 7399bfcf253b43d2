"""The step token budget aimed at a TPOT target: additive increase, multiplicative decrease.

A chunked-prefill engine (Sarathi) runs every decode in every step, so a running request's
time per output token (TPOT) is the step time, and the step's token budget (decodes plus
prefill chunks) sets that time. A fixed budget is a guess made once per model and machine:
too small and prompts queue (TTFT grows), too large and every step makes the decodes wait
(TPOT grows). This controller moves the budget B towards the largest one whose steps still
meet the target, so prefill gets all the room the decodes can spare:

- a step slower than `tpot_target_s`: B <- max(floor, B_used * decrease_factor), where B_used
  is the budget that step ran with (multiplicative decrease);
- a step within the target that filled its budget: B <- min(ceiling, B + increase_tokens)
  (additive increase); a step that left budget unused says nothing about a larger one, so B
  stays (no growth while idle, and no overshoot at the next burst);
- the budget a step gets is B, raised to the floor (the running decodes + `min_prefill_tokens`,
  so decodes always fit and prefill always progresses) and capped by the ceiling (the
  configured budget, `EngineConfig.max_num_batched_tokens`).

Pure code: no torch, no clocks. The engine measures each step and calls `observe`; tests feed
step times directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StepBudgetConfig:
    """The controller's knobs. Times in seconds, budgets in tokens per step."""

    tpot_target_s: float
    ceiling: int  # the configured budget: never more
    increase_tokens: int = 16  # additive increase per step within the target that filled B
    decrease_factor: float = 0.75  # B_used * this after a step over the target
    min_prefill_tokens: int = 16  # the floor leaves at least this much to prefill chunks
    initial: int | None = None  # B at the start; None: the ceiling (the fixed budget's start)

    def __post_init__(self) -> None:
        target = self.tpot_target_s
        if not isinstance(target, (int, float)) or not math.isfinite(target) or target <= 0:
            raise ValueError(f"tpot_target_s must be a finite number > 0, got {target!r}")
        for name in ("ceiling", "increase_tokens", "min_prefill_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0 < self.decrease_factor < 1:
            raise ValueError(f"decrease_factor must be in (0, 1), got {self.decrease_factor!r}")
        if self.initial is not None and not 1 <= self.initial <= self.ceiling:
            raise ValueError(f"initial must be in [1, ceiling={self.ceiling}], got {self.initial}")


class StepBudgetController:
    """B and the rule that moves it. Ask `budget(num_decodes)` before a step, then tell
    `observe(step_s, budget_used, tokens_scheduled, num_decodes)` what the step did."""

    def __init__(self, config: StepBudgetConfig) -> None:
        self.config = config
        self._budget = config.initial if config.initial is not None else config.ceiling
        self.num_increases = 0
        self.num_decreases = 0

    @property
    def current(self) -> int:
        """B, before the per-step floor is applied."""
        return self._budget

    def floor(self, num_decodes: int) -> int:
        """The smallest budget a step gets: every decode plus a minimum prefill chunk (never
        above the ceiling, which caps decodes as a fixed budget does)."""
        return min(self.config.ceiling, num_decodes + self.config.min_prefill_tokens)

    def budget(self, num_decodes: int) -> int:
        """The token budget of the next step, which runs `num_decodes` decodes."""
        return max(self._budget, self.floor(num_decodes))

    def observe(
        self, step_s: float, budget_used: int, tokens_scheduled: int, num_decodes: int
    ) -> int:
        """Update B from one step that took `step_s` seconds with `budget_used` tokens of
        budget, of which it scheduled `tokens_scheduled` (`num_decodes` of them decodes);
        returns the new B."""
        config = self.config
        if step_s > config.tpot_target_s:
            cut = math.floor(budget_used * config.decrease_factor)
            self._budget = max(self.floor(num_decodes), min(cut, config.ceiling), 1)
            self.num_decreases += 1
        elif tokens_scheduled >= budget_used and self._budget < config.ceiling:
            self._budget = min(
                config.ceiling, max(self._budget, budget_used) + config.increase_tokens
            )
            self.num_increases += 1
        return self._budget
