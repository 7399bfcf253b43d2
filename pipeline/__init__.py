"""raypack pipeline: the offline job, the Ray Serve app, and the processor for a user's own
Ray Data program (`ProcessorConfig`, `build_processor`).

The folders: `stages/` (the path the job and the processor share), `processor/`, `io/` (the
job's input and output), `job/` (its driver), `commands/` (the command line), `serve/`;
docs/architecture.md has a line per module.

The names below load on first use (PEP 562): a Ray worker that runs one stage imports that
stage's module only, not the processor, the engine and torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.processor.build import (
        LLMProcessorConfig,
        Processor,
        ProcessorConfig,
        build_processor,
    )

__all__ = ["LLMProcessorConfig", "Processor", "ProcessorConfig", "build_processor"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    from pipeline.processor import build as processor

    return getattr(processor, name)
