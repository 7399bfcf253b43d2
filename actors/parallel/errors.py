"""The parallel engine's failure, in a module of its own: the job's engine stage and feed
catch it without importing the executor (torch and the workers' modules), so an engine actor
imports torch only as its feed builds the engine, with the collector paused
(actors/gc_pause.py)."""

from __future__ import annotations


class WorkerFailedError(RuntimeError):
    """A worker of a parallel engine died or raised; the engine cannot continue."""
