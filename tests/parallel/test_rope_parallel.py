"""Length-dependent rope (longrope) on pipeline-parallel workers: each token's rope length
travels in the step plan, and the later stage's rotary uses it, so short and long prompts
packed together give the single-process engine's tokens (equal to HF's alone:
tests/actors/test_rope_scaling.py). Dynamic NTK on tp ranks: test_failures.py's engine."""

from __future__ import annotations

import pytest

from tests.actors.rope_models import prompts
from tests.parallel.conftest import engine_config, run_engine


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_parallel_rope_matches_single_process(ray_local, rope_dirs) -> None:
    """phi3's fused qkv_proj has no tensor-parallel sharding here: pipeline stages only (a
    llama pp=2 run went the same path as phi3's)."""
    rope_dir = rope_dirs["phi3"]
    batch = prompts([20, 60, 100], seed=13)
    expected = run_engine(engine_config(rope_dir, chunk_size=16), batch, ())
    config = engine_config(rope_dir, chunk_size=16, pipeline_parallel_size=2)
    assert run_engine(config, batch, ()) == expected
