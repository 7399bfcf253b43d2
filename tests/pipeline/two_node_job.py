"""Run the offline job on a simulated two-node cluster (ray.cluster_utils.Cluster), each node
with one fake GPU, so the two engine actors land on different nodes. Run as a script by
test_cluster.py (a process can hold one Ray connection; the test's own Ray is another).

    python tests/pipeline/two_node_job.py TABLE MODEL_DIR OUTPUT
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2]))


def main(table: str, model_dir: str, output: str) -> None:
    """Start the cluster, run the job, print the summary and the node count as JSON."""
    # Cluster ignores its temp-dir arguments (NOTES-ray): RAY_TMPDIR, with ray/ in it, works.
    temp_dir = tempfile.mkdtemp(prefix="rpc", dir="/tmp")
    os.makedirs(os.path.join(temp_dir, "ray"))
    os.environ["RAY_TMPDIR"] = temp_dir
    os.environ.pop("RAY_ADDRESS", None)

    import ray
    import ray.data
    from ray.cluster_utils import Cluster

    from tests.pipeline.test_job import make_config

    # The head keeps a whole CPU free: Ray Data's file-listing task takes one CPU.
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"fake_gpu": 1}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=1, resources={"fake_gpu": 1})
    try:
        ray.init(address=cluster.address)
        from pipeline.job import run_job

        config = make_config(
            Path(table), Path(model_dir), Path(output), num_actors=2, max_rows_per_shard=6
        )
        summary = run_job(config)
        nodes = sum(1 for n in ray.nodes() if n["Alive"])
        print(json.dumps({"nodes": nodes, "rows": summary.rows}))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
