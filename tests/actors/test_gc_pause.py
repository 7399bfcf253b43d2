"""The cyclic collector paused over the heavy imports of a process's start (actors/gc_pause.py),
the engine stage's module light enough that those imports happen inside the pause, and the
start's heap frozen once the engine is built (in fresh processes: freezing is process-wide)."""

from __future__ import annotations

import gc
from pathlib import Path

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
    assert done.stdout.strip() == "[]", done.stdout


def test_a_frozen_heap_is_left_alone_until_thawed_by_the_next_freeze_and_at_exit() -> None:
    script = (
        "import atexit, gc, weakref\n"
        "atexit.register(lambda: print('exit', gc.get_freeze_count()))  # runs last (LIFO)\n"
        "from actors.gc_pause import freeze_heap\n"
        "class Node: pass\n"
        "a = Node(); a.me = a; alive = weakref.ref(a)\n"
        "freeze_heap()\n"
        "print('frozen', gc.get_freeze_count() > 1000, alive() is not None)\n"
        "del a; gc.collect()\n"
        "print('collected', alive() is None)\n"
        "freeze_heap()\n"
        "print('refrozen', alive() is None, gc.get_freeze_count() > 1000)\n"
    )
    done = run_python(script)
    assert done.stdout.split("\n")[:4] == [
        "frozen True True",
        "collected False",  # a dropped cycle that was frozen stays until the next freeze
        "refrozen True True",
        "exit 0",  # thawed once at exit, however often it was frozen
    ], done.stdout


def test_the_engine_feed_freezes_the_heap_once_it_built_its_engine(tmp_path: Path) -> None:
    """The engine actor's path: a feed given no engine builds one in its thread, then freezes
    the heap; the engine generates as before."""
    script = (
        "import gc\n"
        "from tests.tiny_models import save_tiny_model\n"
        f"model = str(save_tiny_model({str(tmp_path / 'model')!r}))\n"
        "from actors import LLMEngine\n"
        "from actors.config import EngineConfig, SamplingParams\n"
        "from pipeline.stages.feed import EngineFeed\n"
        "config = EngineConfig(model=model, dtype='float32')\n"
        "print('before', gc.get_freeze_count())\n"
        "feed = EngineFeed(None, lambda: LLMEngine(config), lambda e: None)\n"
        "print('built', gc.get_freeze_count() > 10000)\n"
        "params = SamplingParams(max_tokens=3)\n"
        "(out,) = feed.generate('s', [[1, 2, 3]], [params], [])\n"
        "(alone,) = LLMEngine(config).generate([[1, 2, 3]], params)\n"
        "print('same', out.token_ids == alone.token_ids, len(out.token_ids))\n"
    )
    done = run_python(script)
    assert done.stdout.split("\n")[:3] == ["before 0", "built True", "same True 3"], done.stdout
