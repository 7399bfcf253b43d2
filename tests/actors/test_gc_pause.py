"""The cyclic collector paused over the heavy imports of a process's start (actors/gc_pause.py),
and the engine stage's module light enough that those imports happen inside the pause."""

from __future__ import annotations

import gc

from actors.gc_pause import gc_paused
from tests.fresh_python import run_python


def test_the_collector_is_off_inside_and_as_it_was_after() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner pause leaves the outer one's state
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller's own "off" is kept
    finally:
        gc.enable()


def test_the_engine_stage_imports_torch_only_when_it_builds_its_engine() -> None:
    """What Ray does in an engine actor before its constructor runs: import Ray Data and the
    stage's module. torch stays out, so the feed's thread imports it as it builds the engine,
    under the pause (pipeline/stages/feed.py; measured in a job's engine actor: 3.1 -> 2.5
    CPU-s for the tiny model), and the job's driver, which builds the stage but never runs
    it, does not import it through this module."""
    script = (
        "import sys\n"
        "import ray.data\n"
        "import pipeline.stages.infer\n"
        "import pipeline.job.run\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    done = run_python(script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout
