"""benchmarks/cpu_noise.py: its burner stops when told and burns, its measuring child
reports the steps and seconds per step of a warm `generate` (a tiny model, the bundled
prompts of tests/data), and its Ray node (idle, or with a Ray Data task that waits) has Ray
Data's actors up and goes when told."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from transformers import AutoTokenizer

from benchmarks import cpu_noise
from tests.actors.reference import sample_prompts
from tests.tiny_models import save_tiny_model


def test_the_burner_burns_in_bursts_and_stops_after_its_seconds():
    wall, cpu = time.monotonic(), time.process_time()
    cpu_noise.burn(period_s=0.01, burst_s=0.005, seconds=0.3)
    assert time.monotonic() - wall >= 0.3  # it ran its time, and returned
    # it spun (~75 ms of spinning wall time; CPU time is less on a busy box), not only slept
    assert time.process_time() - cpu > 0.01


def test_the_measuring_child_reports_every_step_of_its_prompts(tmp_path: Path):
    model = save_tiny_model(tmp_path / "model")
    spec = tmp_path / "spec.json"
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer(text)["input_ids"] for text in sample_prompts(3)]
    spec.write_text(
        json.dumps({"model": str(model), "prompts": prompts, "max_tokens": 4, "threads": 1})
    )
    out = subprocess.run(
        [sys.executable, cpu_noise.__file__, "--measure", str(spec), "0"],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    # three prompts prefilled in one step, then at most 3 more decode steps (ignore_eos off,
    # so an early EOS may end a row sooner): never fewer than 1, never more than 4
    assert 1 <= result["steps"] <= 4
    assert result["step_s"] > 0


def node_processes(node: subprocess.Popen) -> tuple[list[psutil.Process], str]:
    """The node's processes and their command lines."""
    processes = psutil.Process(node.pid).children(recursive=True)
    return processes, " ".join(" ".join(p.cmdline()) for p in processes if p.is_running())


@pytest.mark.timeout(180)
def test_the_ray_node_has_ray_datas_actors_up_and_goes_when_told():
    """One node shows both states: idle after its first pipeline, then told to wait (one Ray
    start instead of one per state)."""
    temp_dir = tempfile.mkdtemp(prefix="rpn", dir="/tmp")  # short: Ray's socket paths
    node = subprocess.Popen(
        [sys.executable, cpu_noise.__file__, "--ray-node"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RAY_TMPDIR": temp_dir},
    )
    try:
        assert cpu_noise.ray_node_says(node, "ready")
        _, names = node_processes(node)
        # the detached actors of Ray Data that a job leaves on a node, and the node itself
        for name in ("ray::_StatsActor", "ray::ActorLocationTracker", "raylet"):
            assert name in names
        assert "MapBatches(Wait)" not in names  # idle: its pipeline is over
        assert cpu_noise.ray_node_says(node, "waiting", "wait")
        processes, names = node_processes(node)
        assert "ray::_StatsActor" in names
        assert "MapBatches(Wait)" in names  # the waiting pipeline's actor holds its one task
        node.terminate()
        assert node.wait(timeout=60) is not None
        _, alive = psutil.wait_procs(processes, timeout=30)
        assert not alive, [" ".join(p.cmdline()) for p in alive]
    finally:
        if node.poll() is None:
            node.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)
