"""Engine actors the cluster can never hold fail the job at once with the arithmetic
(pipeline/job/engine_placement.py `check_actors_fit`), where Ray Data would wait for them forever;
`raypack generate` exits 2 with it."""

from __future__ import annotations

import contextlib
import io

import pytest

from pipeline.config import ComputeConfig, InputConfig, JobConfig, PromptConfig
from pipeline.job.engine_placement import NoRoomError, actor_demand, check_actors_fit
from tests.pipeline.data import TEMPLATE


def job(**compute) -> JobConfig:
    return JobConfig(
        input=InputConfig(path="in.parquet"),
        prompt=PromptConfig(prompt_column="p"),
        output="out",
        compute=ComputeConfig(**compute),
    )


def test_actors_that_fit_pass() -> None:
    check_actors_fit(job(num_actors=2, num_cpus_per_actor=1.0), False, [{"CPU": 2.0}])
    check_actors_fit(job(num_actors=4, num_cpus_per_actor=0.5), False, [{"CPU": 2.0}])
    # One actor per GPU node, two nodes.
    check_actors_fit(job(num_actors=2), True, [{"CPU": 4.0, "GPU": 1.0}] * 2)


def test_too_many_actors_are_refused_with_the_arithmetic() -> None:
    with pytest.raises(NoRoomError) as refused:
        check_actors_fit(job(num_actors=3, num_cpus_per_actor=1.0), False, [{"CPU": 2.0}])
    text = str(refused.value)
    assert "--num-actors 3 engine actors of {'CPU': 1.0} each need CPU 3" in text
    assert "hold at most 2 of them ([2] per node)" in text and "--num-cpus-per-actor" in text


def test_the_scarcest_resource_counts_per_node() -> None:
    # GPUs by default when the cluster has them: 3 actors, 2 GPUs on 2 nodes.
    config = job(num_actors=3, num_cpus_per_actor=0.5)
    assert actor_demand(config, True) == {"CPU": 0.5, "GPU": 1.0}
    with pytest.raises(NoRoomError, match="GPU 3"):
        check_actors_fit(config, True, [{"CPU": 8.0, "GPU": 1.0}] * 2)
    # A custom resource and memory limit them the same way.
    fake = job(num_actors=2, num_cpus_per_actor=0.1, resources=(("fake_gpu", 1.0),))
    with pytest.raises(NoRoomError, match="fake_gpu 2"):
        check_actors_fit(fake, False, [{"CPU": 2.0, "fake_gpu": 1.0}])
    big = job(num_actors=2, num_cpus_per_actor=0.1, memory_gb_per_actor=8)
    with pytest.raises(NoRoomError, match="8 GiB"):
        check_actors_fit(big, False, [{"CPU": 2.0, "memory": 12 * 2**30}])


@pytest.mark.slow
def test_raypack_generate_exits_2_for_actors_the_cluster_cannot_hold(
    ray_cluster, prompt_table, tiny_model_dir, tmp_path
) -> None:
    """The command's `main` in this process, on the package's cluster (as
    test_job_invariants.py runs whole jobs): the exit code the console script exits with,
    without a driver process that imports the job and joins Ray (~5 s of the suite)."""
    from pipeline.commands.generate import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(
            [
                "--input", str(prompt_table), "--output", str(tmp_path / "out"),
                "--template", TEMPLATE, "--model", str(tiny_model_dir),
                "--num-actors", "3", "--num-cpus-per-actor", "1",
            ]
        )  # fmt: skip
    assert code == 2, err.getvalue()[-3000:]
    assert "--num-actors 3 engine actors" in err.getvalue() and "CPU 3" in err.getvalue()
