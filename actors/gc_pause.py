"""Python's cyclic garbage collector paused while a process imports its heavy modules.

Importing torch and transformers' modeling allocates millions of long-lived objects and
almost no garbage, yet CPython's collector runs again and again meanwhile, each full
collection walking the whole heap so far. Measured on the 2-core AMD box (2026-11-27,
`ray.data`, the job's engine stage and the llama model's module): 4.0 CPU-s with the collector,
2.9 without. Every engine actor, parallel worker and Serve replica pays it once at start,
and on a node that is starting several of them the cores are the start's bottleneck.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


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
