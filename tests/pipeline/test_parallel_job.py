"""The offline job with tensor/pipeline-parallel engines: one placement group per engine actor,
tokens equal to Hugging Face's on each prompt alone (as the single-process engine's job is,
test_job), a worker killed mid-shard redone on a fresh engine, retries that run out failing
the job, and groups the cluster cannot hold failing fast."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import ray
from ray.util.placement_group import placement_group_table

from pipeline.job.engine_placement import check_cpu_room
from pipeline.job.run import run_job
from pipeline.stages.infer import InferStage
from tests.pipeline.data import MALFORMED, TEMPLATE, rows
from tests.pipeline.test_job import make_config, read_output

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]


def parallel_config(table: Path, model_dir: Path, output: Path, tp: int = 1, pp: int = 1, **kw):
    """make_config's job with a tp x pp engine of 0.25-CPU workers (four fit on two cores)."""
    # One partition: these tests are about the tp x pp engines, not the keyed shuffle (whose
    # aggregator actors cost seconds per job on two cores; test_job and two_node_job cover it).
    config = make_config(table, model_dir, output, max_rows_per_shard=8, num_partitions=1)
    engine = replace(
        config.engine, tensor_parallel_size=tp, pipeline_parallel_size=pp, worker_num_cpus=0.25
    )
    return replace(config, engine=engine, compute=replace(config.compute, **kw))


@pytest.fixture(scope="module")
def reference(prompt_table, tiny_model_dir) -> dict[str, list[int]]:
    """Each valid row's tokens from Hugging Face `generate` on its prompt alone (the template
    filled by str.format, the row's max_tokens or the job's 4): what test_job checks the
    single-process engine's job against, so a tp x pp job must give the same."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.actors.reference import hf_greedy, torch_threads

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch_threads(1):
        return {
            row["id"]: hf_greedy(
                model,
                tokenizer.encode(TEMPLATE.format(**row), add_special_tokens=False),
                row["max_tokens"] or 4,
            )
            for row in rows()
            if row["id"] not in MALFORMED
        }


def assert_same_rows(out: dict[str, dict], reference: dict[str, list[int]]) -> None:
    assert set(out) == {r["id"] for r in rows()}
    for row_id, expected in reference.items():
        assert out[row_id]["error"] is None, (row_id, out[row_id]["error"])
        assert out[row_id]["generated_token_ids"] == expected, row_id
    assert {i for i, r in out.items() if r["error"] is not None} == MALFORMED


def no_group_left() -> bool:
    return all(g["state"] == "REMOVED" for g in placement_group_table().values())


def test_tp2_job_equals_single_engine(
    ray_cluster, reference, prompt_table, tiny_model_dir, tmp_path
) -> None:
    run_job(parallel_config(prompt_table, tiny_model_dir, tmp_path / "out", tp=2))
    assert_same_rows(read_output(tmp_path / "out"), reference)
    assert no_group_left()


def crash_once_stage(marker: Path, stage: int, rank: int) -> type[InferStage]:
    """An InferStage whose first shard has worker (stage, rank) exit two steps in, once; it
    counts the engines it builds in `<marker>.engines`."""

    class CrashOnce(InferStage):
        def _new_engine(self, beside=None):
            with marker.with_suffix(".engines").open("a") as f:
                f.write("engine\n")
            return super()._new_engine(beside)

        def run_shard(self, shard):
            if not marker.exists():
                marker.write_text("crashed")
                executor = self.engine.runner
                worker = executor.workers[stage][rank]
                ray.get(worker.crash_at_step.remote(executor._step + 2))
            return super().run_shard(shard)

    return CrashOnce


def test_pp2_worker_killed_mid_shard_is_redone_on_a_fresh_engine(
    ray_cluster, reference, prompt_table, tiny_model_dir, tmp_path
) -> None:
    marker = tmp_path / "crashed"
    config = parallel_config(prompt_table, tiny_model_dir, tmp_path / "out", pp=2)
    run_job(config, infer_cls=crash_once_stage(marker, stage=1, rank=0))
    assert marker.exists()
    # One actor, never restarted: its first engine and the fresh one that redid the shard.
    assert marker.with_suffix(".engines").read_text().count("engine") == 2
    assert_same_rows(read_output(tmp_path / "out"), reference)  # every id once, same tokens
    assert no_group_left()


def test_retries_spent_fail_the_job_with_the_cause(
    ray_cluster, prompt_table, tiny_model_dir, tmp_path
) -> None:
    config = parallel_config(
        prompt_table, tiny_model_dir, tmp_path / "out", tp=2, engine_retries=0, max_restarts=0
    )
    with pytest.raises(Exception, match=r"failed 1 times \(engine_retries=0\).*tp rank 1 failed"):
        run_job(config, infer_cls=crash_once_stage(tmp_path / "crashed", stage=0, rank=1))
    assert no_group_left()


def test_groups_the_cluster_cannot_hold_fail_fast(
    ray_cluster, prompt_table, tiny_model_dir, tmp_path
) -> None:
    config = parallel_config(prompt_table, tiny_model_dir, tmp_path / "out", tp=2, num_actors=3)
    config = replace(config, engine=replace(config.engine, worker_num_cpus=0.5))
    with pytest.raises(ValueError, match=r"3 engine actors .* can never be placed: 3 groups"):
        run_job(config)


def test_wait_for_nodes_waits_then_times_out_naming_what_is_free(
    ray_cluster, prompt_table, tiny_model_dir, tmp_path
) -> None:
    """On an autoscaling cluster the nodes up now are not all there will be: no fail-fast
    check, the groups are waited for, and a timeout says what the cluster has free."""
    config = parallel_config(
        prompt_table,
        tiny_model_dir,
        tmp_path / "out",
        tp=2,
        num_actors=3,
        wait_for_nodes=True,
        placement_timeout_s=3.0,
    )
    with pytest.raises(TimeoutError, match=r"not placed within 3 s.*free"):
        run_job(config)
    assert no_group_left()  # the groups already placed are released too


@pytest.mark.timeout(30)
def test_cpu_room_is_checked_per_node(prompt_table, tiny_model_dir, tmp_path) -> None:
    """Four 0.6-CPU actors on four 1-CPU nodes leave 1.35 CPUs in all but no whole one."""
    config = parallel_config(
        prompt_table, tiny_model_dir, tmp_path, num_actors=4, num_cpus_per_actor=0.6
    )
    with pytest.raises(ValueError, match="leave no node with a whole CPU free"):
        check_cpu_room(config, False, [{"CPU": 1.0}] * 4)
    check_cpu_room(config, False, [{"CPU": 1.0}] * 5)
    # A tp=2 engine actor's group holds 0.25 + 2 x 0.25 CPUs; a tokenizer 0.25.
    tp2 = parallel_config(prompt_table, tiny_model_dir, tmp_path, tp=2)
    check_cpu_room(tp2, False, [{"CPU": 2.0}])
    with pytest.raises(ValueError, match=r"hold 1.75 CPUs \(\[0.75, 0.75, 0.25\]\)"):
        check_cpu_room(
            replace(tp2, compute=replace(tp2.compute, num_actors=2)), False, [{"CPU": 2.0}]
        )
