"""Python's cyclic garbage collector paused while a process imports its heavy modules, and the
start's heap frozen once an engine is built.

Importing torch and transformers' modeling allocates millions of long-lived objects and
almost no garbage, yet CPython's collector runs again and again meanwhile, each full
collection walking the whole heap so far. Measured on the 2-core AMD box (2026-11-27,
`ray.data`, the job's engine stage and the llama model's module): 4.0 CPU-s with the collector,
2.9 without. Every engine actor, parallel worker and Serve replica pays it once at start,
and on a node that is starting several of them the cores are the start's bottleneck.

Once its engine is built, such a process keeps that heap (~430,000 objects: the modules, the
model, the tokenizer) for its life, and each full collection while it steps walks all of it:
~0.27 s on the 2-core Zen 4 box, once per one or two 175-prompt calls. `freeze_heap` moves
them out of the collector's reach (`gc.freeze`), as vLLM's engine core does after its start.
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")


@contextmanager
def gc_paused() -> Iterator[None]:
    """Run the block with the cyclic collector off (as it was after: a caller that had it
    off keeps it off). The cycles the block leaves are collected at the next collection."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def call_paused(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` with the collector paused (for another thread's build: `submit(call_paused,
    LLMEngine, config)`)."""
    with gc_paused():
        return fn(*args)


def freeze_heap() -> None:
    """Collect, then freeze every object left (`gc.freeze`): full collections from here on walk
    only what came after. For a process that keeps its engine for its life (an engine actor, a
    Serve replica, a tensor/pipeline-parallel worker). Callable again after a rebuild: it thaws
    first, so the replaced engine's cycles are collected. Thawed at exit, so that the
    interpreter's shutdown finalizes the frozen objects as it would any other."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # registered once, however often this is called
    atexit.register(gc.unfreeze)
