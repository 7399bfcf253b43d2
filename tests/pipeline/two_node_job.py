"""Run the offline job on a simulated two-node cluster (ray.cluster_utils.Cluster). Run as a
script by test_cluster.py (a process can hold one Ray connection; the test's own Ray is another).

    python tests/pipeline/two_node_job.py TABLE MODEL_DIR OUTPUT

Each node has one fake GPU. First OUTPUT/dp: two engine actors, which land on different
nodes. Then OUTPUT/pp: one engine actor with a pipeline-parallel engine (pp=2, STRICT_SPREAD)
whose two stages are on the two nodes, with tests/parallel's chunked prefill (7-token chunks,
48-token steps), so the job's prefix groups and prompts cross the nodes a chunk at a time.
(Until 2026-11-26 a third, job-less pp=2 engine ran here on tests/parallel's prompts: the
same stages and transfers, and a third engine's workers on two cores.) One cluster serves
both (starting one is the slow part). Writes a JSON file: node count, each job's rows, each
pp stage's node.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2]))


def node_recording_stage(record: Path):  # noqa: ANN201 (an InferStage subclass)
    """An InferStage that writes its engine's stage workers' node ids to `record`."""
    import ray

    from pipeline.stages.infer import InferStage

    class RecordNodes(InferStage):
        def run_shard(self, shard):
            workers = self.engine.runner.workers
            nodes = ray.get([stage[0].node_id.remote() for stage in workers])
            record.write_text(json.dumps(nodes))
            return super().run_shard(shard)

    return RecordNodes


def main(table: str, model_dir: str, output: str) -> None:
    """Start the cluster, run both jobs, write their row counts and the node count as JSON to
    `output`/result.json (not stdout: Ray's log monitor may print to stdout after us)."""
    # Cluster ignores its temp-dir arguments (NOTES-ray): RAY_TMPDIR, with ray/ in it, works.
    temp_dir = tempfile.mkdtemp(prefix="rpc", dir="/tmp")
    os.makedirs(os.path.join(temp_dir, "ray"))
    os.environ["RAY_TMPDIR"] = temp_dir
    os.environ.pop("RAY_ADDRESS", None)

    import ray
    import ray.data
    from ray.cluster_utils import Cluster

    from tests.pipeline.test_job import make_config
    from tests.pipeline.test_parallel_job import parallel_config

    # The head keeps a whole CPU free: Ray Data's file-listing task takes one CPU.
    # Idle workers kept as the pipeline tests' Ray keeps them (tests/pipeline/conftest.py): the
    # pp job's tasks reuse the dp job's worker processes instead of starting new ones.
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {"fake_gpu": 1},
            "include_dashboard": False,
            "_system_config": {"num_workers_soft_limit": 16},
        },
    )
    cluster.add_node(num_cpus=1, resources={"fake_gpu": 1})
    try:
        ray.init(address=cluster.address)
        from pipeline.job.run import run_job

        result: dict = {"nodes": sum(1 for n in ray.nodes() if n["Alive"])}
        dp = make_config(
            Path(table), Path(model_dir), Path(output) / "dp", num_actors=2, max_rows_per_shard=6
        )
        result["dp_rows"] = run_job(dp).rows
        pp = parallel_config(Path(table), Path(model_dir), Path(output) / "pp", pp=2)
        chunked = dict(chunk_size=7, max_num_batched_tokens=48)  # tests/parallel's engine_config
        pp = replace(pp, engine=replace(pp.engine, placement_strategy="STRICT_SPREAD", **chunked))
        record = Path(output) / "stage_nodes.json"
        result["pp_rows"] = run_job(pp, infer_cls=node_recording_stage(record)).rows
        result["stage_nodes"] = json.loads(record.read_text())
        (Path(output) / "result.json").write_text(json.dumps(result))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
