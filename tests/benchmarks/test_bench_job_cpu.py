"""benchmarks/bench_job_cpu.py: a job's CPU seconds per process name from the sampler's
snapshots (no job run here: the snapshots are written out as /proc would give them)."""

from __future__ import annotations

from benchmarks.bench_job_cpu import UNNAMED, cpu_seconds, summarize
from benchmarks.cpu_share import _TICKS, CpuSampler


def test_cpu_seconds_count_from_the_first_sample_and_keep_an_exiting_process_name():
    sampler = CpuSampler()
    t = _TICKS
    sampler.samples = [
        (0.0, {1: ("raylet", 5 * t), 9: ("driver (this benchmark)", 0)}),
        (1.0, {1: ("raylet", 6 * t), 2: ("ray::IDLE", 1 * t), 9: ("driver (this benchmark)", t)}),
        (2.0, {1: ("raylet", 7 * t), 2: ("ray::MapWorker(MapBatches(InferStage))", 4 * t)}),
        (3.0, {1: ("raylet", 7 * t), 2: (UNNAMED, 5 * t), 3: (UNNAMED, 2 * t)}),
    ]
    used = cpu_seconds(sampler, own_pid=9)
    assert used == {
        "raylet": 2.0,  # 7 - 5: what it had before the first sample is not the job's
        "ray::MapWorker(MapBatches(InferStage))": 5.0,  # started in the window; kept its name
        UNNAMED: 2.0,  # never named: a kernel thread or a process that had no command line
    }


def test_summarize_takes_medians_and_folds_small_names_into_other():
    runs = [
        {"cpu_s": {"a": 3.0, "b": 0.05}, "total_cpu_s": 3.05, "job": {"wall_s": 10.0}},
        {"cpu_s": {"a": 5.0, "c": 0.01}, "total_cpu_s": 5.01, "job": {"wall_s": 12.0}},
        {"cpu_s": {"a": 4.0}, "total_cpu_s": 4.0, "job": {"wall_s": 11.0}},
    ]
    out = summarize(runs, min_s=0.1)
    assert out["cpu_s"] == {"a": 4.0, "other": 0.0}
    assert out["total_cpu_s"] == 4.0
    assert out["wall_s_runs"] == [10.0, 12.0, 11.0]
    assert out["job"] == {"wall_s": 11.0}
