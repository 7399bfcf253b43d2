"""Shared test setup: GPU tests are skipped without CUDA; torch uses the machine's cores;
no test reaches the Hugging Face hub (HF_HUB_OFFLINE=1, inherited by the commands and Ray
workers tests start); idle OpenMP threads sleep instead of spinning (OMP_WAIT_POLICY); no Ray
usage stats (one process fewer per Ray); the objects of the imports left out of the test
processes' later garbage collections (`gc.freeze`)."""

from __future__ import annotations

import gc
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite runs two xdist workers on two cores, each with torch (the job's engine actors on
# two threads, `pipeline/stages/engine_actor.default_torch_threads`): libgomp's threads spin-wait
# for work between ops by default, so two such pools oversubscribe the cores and each op's
# hand-off waits for a spinning thread's time slice. PASSIVE makes them sleep. Set before
# any test imports torch (libgomp reads it when loaded); the commands and Ray workers the
# tests start inherit it. Measured (2026-11-26, a tiny-model engine, 16 prompts x 100 tokens
# beside one busy process): 2 threads 15.7-18.3 s spinning, 1.0-1.4 s passive.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# No Ray usage stats from tests: with them on, every Ray the tests start (the job tests' own,
# each command's, the two-node cluster) runs Ray Data's `_UsageCollectionActor`, one more worker
# process, to record each dataset run; nothing a test checks needs it.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `gpu` when no CUDA device is present."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection left (the test modules and their imports: torch, transformers,
    Ray, ~300,000 objects), so each later full collection walks only what tests made. The
    tests build models and engines by the hundred, and CPython's full collections, each over
    the whole heap, ran often: tests/actors/test_exactness.py, test_architectures.py and
    tests/test_tiny_models.py took 42.2 s (38.0 CPU-s) without, 35.3 s (30.7) with
    (2026-11-27, 2-core AMD). An engine alone does not need it: one `generate` of 175 prompts
    ran no full collection."""
    gc.freeze()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Back to the collector before the exit (frozen objects are never freed, and nanobind's
    leak check then lists its objects as leaked)."""
    gc.unfreeze()
