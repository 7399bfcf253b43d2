"""raypack actors: the inference engine (scheduler, paged KV cache, model runner, sampler).

The names below load on first use (PEP 562), so `import actors.config` (what the job's CPU
stages and the command line need) does not import torch: a Ray worker that plans or
tokenizes starts in a fraction of the time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from actors.gc_pause import gc_paused

if TYPE_CHECKING:
    from actors.config import EngineConfig, SamplingParams
    from actors.engine import LLMEngine
    from actors.outputs import RequestOutput, TokenLogprob

_HOME = {
    "EngineConfig": "actors.config",
    "SamplingParams": "actors.config",
    "LLMEngine": "actors.engine",
    "RequestOutput": "actors.outputs",
    "TokenLogprob": "actors.outputs",
}

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "TokenLogprob"]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    with gc_paused():  # the first use imports torch and transformers (actors/gc_pause.py)
        module = importlib.import_module(_HOME[name])
    return getattr(module, name)
