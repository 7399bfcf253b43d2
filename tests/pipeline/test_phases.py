"""The job's phases (pipeline/job/phases.py): marks to durations, several engines merged, the
printed line, this process's start."""

from __future__ import annotations

import time

from pipeline.job.phases import EngineMarks, JobClock, phases_line, process_start


def clock_at(**marks: float) -> JobClock:
    clock = JobClock(start=100.0)
    for name, at in marks.items():
        clock.mark(name, 100.0 + at)
    return clock


def test_the_phases_of_a_command_from_its_marks() -> None:
    clock = clock_at(command=1.0, checked=1.5, ray_up=4.5, job=4.6, planned=7.0, written=20.4)
    clock.mark("reported", 121.0)
    engine = EngineMarks(
        process=105.0, constructed=106.0, loaded=108.5, first_step=108.7, last_step=120.0
    )
    assert clock.phases(engine) == {
        "imports": 1.0,
        "check": 0.5,
        "ray_start": 3.0,
        "read_plan": 2.4,
        "engine_start": 1.4,
        "engine_process": 0.4,  # the job's start (104.6) -> the actor's process started
        "engine_imports": 1.0,  # -> its constructor
        "engine_load": 2.5,
        "first_step": 0.2,  # from the engine ready (after the plan): 108.5 -> 108.7
        "to_first_step": 8.7,
        "steps": 11.3,
        "last_write": 0.4,
        "report": 0.6,
    }


def test_first_step_waits_for_the_later_of_plan_and_engine() -> None:
    clock = clock_at(job=0.0, planned=9.0)
    engine = EngineMarks(constructed=101.0, loaded=103.0, first_step=109.5, last_step=112.0)
    phases = clock.phases(engine)
    assert phases["first_step"] == 0.5
    # No command marks (a library's run_job): the start-up counts from the job's start.
    assert phases["to_first_step"] == 9.5
    assert "imports" not in phases and "ray_start" not in phases


def test_missing_marks_leave_their_phases_out() -> None:
    assert clock_at(command=1.0).phases() == {"imports": 1.0}
    assert clock_at(job=0.0).phases(EngineMarks()) == {}


def test_engines_merge_to_the_first_start_and_the_last_step() -> None:
    a = EngineMarks(process=4.0, constructed=5.0, loaded=7.0, first_step=8.0, last_step=50.0)
    b = EngineMarks(process=3.5, constructed=6.0, loaded=6.5, first_step=None, last_step=None)
    c = EngineMarks(constructed=9.0, loaded=11.0, first_step=12.0, last_step=60.0)
    merged = a.merged(b).merged(c)
    assert merged == EngineMarks(
        process=3.5, constructed=5.0, loaded=6.5, first_step=8.0, last_step=60.0
    )
    assert EngineMarks().merged(EngineMarks()) == EngineMarks()


def test_the_printed_line_names_the_start_up_and_the_tail() -> None:
    phases = {
        "imports": 1.0, "check": 0.5, "ray_start": 3.0, "read_plan": 2.4,
        "engine_start": 1.4, "engine_load": 2.5, "first_step": 0.2, "to_first_step": 8.7,
        "steps": 11.3, "last_write": 0.4, "report": 0.6, "shutdown": 1.2,
    }  # fmt: skip
    assert phases_line(phases) == (
        "first step at 8.7s (imports 1.0, check 0.5, Ray 3.0, read+plan 2.4, engine start "
        "1.4, load 2.5, first step 0.2); steps 11.3s; then write 0.4, report 0.6, "
        "shutdown 1.2"
    )
    assert phases_line({}) == ""


def test_an_engine_on_a_worker_started_before_the_job() -> None:
    """Ray may give the actor a worker it started earlier: no process phase to wait for, and
    its imports count from the process's start."""
    clock = clock_at(job=5.0)
    engine = EngineMarks(process=102.0, constructed=108.0)
    phases = clock.phases(engine)
    assert phases["engine_process"] == 0.0 and phases["engine_imports"] == 6.0
    assert phases["engine_start"] == 3.0


def test_this_process_started_before_now() -> None:
    started = process_start()
    assert started is not None  # Linux: /proc
    assert time.time() - 3600 < started <= time.time()
