"""The memory allocator of the engine's processes: tcmalloc where the machine has it.

glibc's malloc hands large blocks (a step's activations, a 49,152-wide row of logits per
sequence) back to the kernel early on and gets fresh, zeroed pages for the next ones;
tcmalloc keeps freed blocks for reuse. Measured on a 2-core AMD EPYC
(docs/benchmarks-job-engine.md, "The allocator"): a 525-prompt float32 job's engine steps
took 36.6-37.7 s with its engine actor on tcmalloc against 41.6-42.3 s on glibc's (the job
44.1-45.6 s against 48.9-49.6 s), and an engine's first `generate` lost its ~1.4 s penalty;
an engine alone on 175 chat prompts took ~5 % less on its later calls too
(docs/benchmarks-peers.md, session (5)). vLLM's CPU backend asks for
tcmalloc the same way (an `LD_PRELOAD`); here the job, the processor and Serve set it on
their engine processes themselves (`preload_env`, a Ray `runtime_env`), so nobody has to
remember it. It has to be there before the process starts: an engine built
in a user's own process (`LLMEngine`) keeps the process's allocator.

tcmalloc comes with the OS (`apt install libtcmalloc-minimal4`, `dnf install
gperftools-libs`); no wheel ships it. `auto` uses it when the driver's machine has it (a
cluster's nodes are taken to be alike; a node without it runs on with glibc, the dynamic
loader says so in the actor's log).
"""

from __future__ import annotations

import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

ALLOCATORS: tuple[str, ...] = ("auto", "tcmalloc", "system")
_LIBRARY = "tcmalloc_minimal"  # gperftools' tcmalloc without the heap profiler (vLLM's choice)


def find_tcmalloc() -> str | None:
    """The tcmalloc library's name as the dynamic loader finds it (`libtcmalloc_minimal.so.4`),
    or None when this machine has none."""
    return ctypes.util.find_library(_LIBRARY)


def check_allocator(allocator: str) -> None:
    """A ValueError naming the choices unless `allocator` is one of them (the configs that
    carry it check it when built)."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {ALLOCATORS}, got {allocator!r}")


def preload_env(allocator: str) -> dict[str, str]:
    """Environment variables that give a new process `allocator`: {"LD_PRELOAD": ...} for
    tcmalloc (ahead of what this process already preloads), {} for the system's. `tcmalloc`
    where it is missing is a ValueError; `auto` then falls back to the system's."""
    check_allocator(allocator)
    if allocator == "system":
        return {}
    library = find_tcmalloc()
    if library is None:
        if allocator == "tcmalloc":
            raise ValueError(
                f"--allocator tcmalloc: lib{_LIBRARY} is not installed on this machine "
                "(apt install libtcmalloc-minimal4, or dnf install gperftools-libs)"
            )
        logger.info(
            "engine actors use the system allocator: no lib%s here (apt install "
            "libtcmalloc-minimal4 makes their steps faster)",
            _LIBRARY,
        )
        return {}
    preloaded = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    return {"LD_PRELOAD": ":".join([library, *(p for p in preloaded if p != library)])}
