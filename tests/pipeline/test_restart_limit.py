"""Actor restart limits: a shard that kills its engine actor every time ends the job after
`max_restarts` retries (no endless retry), the other shards' rows are kept, and a rerun
completes the table with every id exactly once (the rerun, in two-row shards, is also the
continuous feed's job: test_continuous_feed.py)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.job.run import run_job
from pipeline.stages import stage
from pipeline.stages.infer import InferStage
from tests.pipeline.data import rows
from tests.pipeline.test_continuous_feed import assert_many_small_shards_equal_the_engine
from tests.pipeline.test_job import make_config, read_output

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
POISON = "heapq-2"  # a row whose shard kills its actor


def poison_stage(attempts: Path) -> type[InferStage]:
    """An InferStage whose actor process dies whenever its shard holds POISON; each death
    is one line in `attempts` (written before the process exits)."""

    class Poison(InferStage):
        def run_shard(self, shard):
            if shard.num_rows and POISON in shard.column(stage.ID)[0].as_py():
                with attempts.open("a") as f:
                    f.write(f"{os.getpid()}\n")
                os._exit(1)
            return super().run_shard(shard)

    return Poison


@pytest.mark.parametrize("max_restarts", [1])
def test_a_shard_that_always_kills_its_actor_ends_the_job_after_the_limit(
    ray_cluster, prompt_table, tiny_model_dir, tmp_path, max_restarts
) -> None:
    assert POISON in {r["id"] for r in rows()}
    output = tmp_path / "out"
    config = make_config(
        prompt_table, tiny_model_dir, output, max_rows_per_shard=4, num_partitions=1
    )
    config = replace(config, compute=replace(config.compute, max_restarts=max_restarts))
    attempts = tmp_path / "attempts"
    with pytest.raises(Exception) as failed:  # noqa: PT011 (Ray's error type for a dead actor)
        run_job(config, infer_cls=poison_stage(attempts))
    assert "died" in str(failed.value).lower() or "actor" in str(failed.value).lower()
    # the first try plus one per allowed restart, and no more
    assert len(attempts.read_text().splitlines()) == max_restarts + 1

    done = read_output(output) if output.exists() else {}
    assert POISON not in done
    # the rerun (shards of another size: the ids written, not the shards, say what is left):
    # the finished rows are skipped, the rest done. Two rows per shard: it is also the
    # continuous feed's job with many small shards (test_continuous_feed.py's assertions).
    rerun = replace(config, plan=replace(config.plan, max_rows_per_shard=2))
    summary = run_job(rerun)
    out = read_output(output)
    assert set(out) == {r["id"] for r in rows()}  # every id, each once
    assert summary.rows_skipped == len(done)
    assert_many_small_shards_equal_the_engine(rerun, out, tiny_model_dir)
