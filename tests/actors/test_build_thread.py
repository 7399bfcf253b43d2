"""An engine stepped in another thread than the one that built it: one warning, with the
remedy, when the two OpenMP pools would outnumber the cores; none in the building thread
(actors/build_thread.py)."""

from __future__ import annotations

import logging
import threading

import pytest

from actors import SamplingParams
from actors.build_thread import BuildThread, usable_cores
from tests.actors.reference import torch_threads

WARNING = "OpenMP thread pools"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]


def test_pools_contend_only_with_two_multi_threaded_pools_over_the_cores() -> None:
    with torch_threads(2):
        built = BuildThread()
    cores = usable_cores()
    assert built.pools_contend(2) == (4 > cores)
    assert not built.pools_contend(1)  # one thread in the stepping thread: no second pool
    with torch_threads(1):
        assert not BuildThread().pools_contend(cores + 1)  # no pool where it was built


def test_an_engine_stepped_elsewhere_warns_once_when_pools_contend(make_engine, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="actors.build_thread")
    with torch_threads(2):
        engine = make_engine("llama")
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.generate(["Hello there"], params)  # the building thread: no warning
    assert _warnings(caplog) == []

    def elsewhere() -> None:
        with torch_threads(2):
            engine.generate(["Hello there", "Good day"], params)
            engine.generate(["Hello again"], params)

    worker = threading.Thread(target=elsewhere, name="stepper")
    worker.start()
    worker.join()
    found = _warnings(caplog)
    if 4 > usable_cores():
        assert len(found) == 1  # once, not per step
        assert "'stepper' with 2" in found[0] and "torch.set_num_threads(1)" in found[0]
    else:
        assert found == []
