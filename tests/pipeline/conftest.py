"""Ray for the pipeline tests: one local cluster per test package run, in a fresh temp dir,
with two fake GPUs; a tiny model folder; the synthetic prompt table."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pipeline.data import write_prompt_table
from tests.tiny_models import save_tiny_model


@pytest.fixture(scope="package")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama with the SmolLM2 tokenizer (context 512)."""
    return save_tiny_model(tmp_path_factory.mktemp("pipeline-tiny") / "model")


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[str]:
    """A local Ray (2 CPUs, resource fake_gpu=2) for this package's tests; yields its GCS
    address so subprocess drivers can join it. Package scope: it is shut down before other
    test folders start their own."""
    import ray
    import ray.data

    # A short path: Ray's unix sockets live under it.
    temp_dir = tempfile.mkdtemp(prefix="rpp", dir="/tmp")
    ray.init(
        num_cpus=2,
        resources={"fake_gpu": 2},
        _temp_dir=temp_dir,
        include_dashboard=False,
        # Keep up to 16 idle workers between tasks (Ray's default keeps num_cpus): each job's
        # read, plan and write tasks then reuse the last job's workers instead of starting
        # new processes (test_duplicate_ids.py's three jobs alone: 45-49 s -> 38 s).
        _system_config={"num_workers_soft_limit": 16},
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="package")
def prompt_table(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic table of tests/pipeline/data.py as Parquet."""
    return write_prompt_table(tmp_path_factory.mktemp("pipeline-data") / "prompts.parquet")
