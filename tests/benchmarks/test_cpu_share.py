"""benchmarks/cpu_share.py: process names as the job's processes show them, and the cores a
busy process held over a sampled window (Linux /proc)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from benchmarks.cpu_share import CpuSampler, process_name


def test_names_keep_rays_titles_and_name_scripts_by_file():
    own = 10
    assert process_name(b"ray::MapWorker(MapBatches(InferStage)).submit\0", 5, own) == (
        "ray::MapWorker(MapBatches(InferStage))"
    )
    assert process_name(b"ray::IDLE\0", 5, own) == "ray::IDLE"
    assert process_name(b"/venv/bin/python\0-u\0/x/ray/_private/log_monitor.py\0--a\0", 5, own) == (
        "python log_monitor.py"
    )
    assert process_name(b"/x/ray/core/src/ray/raylet/raylet\0--flag\0", 5, own) == "raylet"
    assert process_name(b"python3\0-m\0pytest\0-q\0", 5, own) == "python -m pytest"
    assert process_name(b"", 5, own) == "kernel or unnamed"
    assert process_name(b"anything\0", own, own) == "driver (this benchmark)"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_busy_process_shows_up_with_its_cores_and_a_short_window_gives_nothing(tmp_path):
    # a script of its own name: `python -c` would also match pytest-xdist's workers
    burner_script = tmp_path / "burner.py"
    burner_script.write_text(
        "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass\n"
    )
    sampler = CpuSampler(interval=0.2).start()
    burner = subprocess.Popen([sys.executable, str(burner_script)])
    burner.wait()  # it ended before the window's last samples: still counted
    time.sleep(0.5)
    sampler.stop()
    start, end = sampler.samples[0][0], sampler.samples[-1][0]
    cores = sampler.cores_between(start, end)
    assert 0 < cores["python burner.py"] <= 1.05, cores  # one busy thread: at most one core
    assert sampler.cores_between(end + 1, end + 2) == {}  # no samples in that window
