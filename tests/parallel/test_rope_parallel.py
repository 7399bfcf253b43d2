"""Length-dependent rope (longrope, dynamic NTK) on tensor/pipeline-parallel workers: each
token's rope length travels in the step plan, and the workers' rotary uses it, so short and
long prompts packed together give the single-process engine's tokens (equal to HF's alone:
tests/actors/test_rope_scaling.py)."""

from __future__ import annotations

import pytest

from actors.loader import load_tokenizer
from tests.actors.rope_models import prompts, rope_model
from tests.parallel.conftest import engine_config, run_engine


@pytest.fixture(scope="module")
def rope_dirs(tmp_path_factory):
    """Saved tiny rope models (phi3 longrope, llama dynamic) with the SmolLM2 tokenizer."""
    folders = {}
    for kind in ("phi3", "llama"):
        folders[kind] = tmp_path_factory.mktemp("rope") / kind
        rope_model(kind).save_pretrained(folders[kind])
        load_tokenizer("smollm2").save_pretrained(folders[kind])
    return folders


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "kind,tp,pp",
    # phi3's fused qkv_proj has no tensor-parallel sharding here: pipeline stages only. Each
    # rope kind once: dynamic (llama) on tp ranks, longrope (phi3) on pp stages, where the
    # later stage takes the rope lengths from the step plan as the first does (a llama pp=2
    # run went the same path as phi3's).
    [("llama", 2, 1), ("phi3", 1, 2)],
    ids=["llama-tp2", "phi3-pp2"],
)
def test_parallel_rope_matches_single_process(ray_local, rope_dirs, kind, tp, pp) -> None:
    rope_dir = rope_dirs[kind]
    batch = prompts([20, 60, 100], seed=13)
    expected = run_engine(engine_config(rope_dir, chunk_size=16), batch, ())
    config = engine_config(
        rope_dir, chunk_size=16, tensor_parallel_size=tp, pipeline_parallel_size=pp
    )
    assert run_engine(config, batch, ()) == expected
