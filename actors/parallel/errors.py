"""The parallel engine's failure, in a module of its own: the job's engine stage and feed
catch it without importing the executor (torch and the workers' modules, 3 CPU-s in the job's
driver, which builds the stage but never runs it)."""

from __future__ import annotations


class WorkerFailedError(RuntimeError):
    """A worker of a parallel engine died or raised; the engine cannot continue."""
