"""Ray and tiny saved models for the parallel-engine tests.

One local Ray for the folder's tests (kept from module to module), in a fresh short temp dir
(Ray's unix sockets live under it), with 2 CPUs: workers take fractional CPUs so four fit.
Models are the engine tests' context models (attention really moves the logits) saved as
safetensors, so workers load shards.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from actors import EngineConfig, LLMEngine, SamplingParams
from actors.loader import load_tokenizer
from tests.actors.groups import prefix_groups_for, shared_prefix_prompts
from tests.actors.reference import assert_greedy_match, torch_threads
from tests.tiny_models import tiny_model

MAX_TOKENS = 8


def context_model(arch: str, num_layers: int = 2):
    """A tiny model whose next token depends on the context (tests.tiny_models)."""
    return tiny_model(arch, num_layers=num_layers)


def save_context_model(folder: Path, arch: str, num_layers: int = 2) -> Path:
    """Save a context model and the SmolLM2 tokenizer as a loadable folder."""
    context_model(arch, num_layers).save_pretrained(folder)
    load_tokenizer("smollm2").save_pretrained(folder)
    return folder


@pytest.fixture(scope="package")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer context llama (4 heads, 2 KV heads)."""
    return save_context_model(tmp_path_factory.mktemp("par") / "llama", "llama")


@pytest.fixture(scope="package")
def rope_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Saved tiny rope models (phi3 longrope, llama dynamic NTK) with the SmolLM2 tokenizer."""
    from tests.actors.rope_models import rope_model

    folders = {}
    for kind in ("phi3", "llama"):
        folders[kind] = tmp_path_factory.mktemp("rope") / kind
        rope_model(kind).save_pretrained(folders[kind])
        load_tokenizer("smollm2").save_pretrained(folders[kind])
    return folders


@pytest.fixture(scope="package")
def ray_temp_dir() -> Iterator[str]:
    """The folder's Ray temp dir; whatever Ray is still up when the folder's tests end is shut
    down then."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="rpx", dir="/tmp")
    try:
        yield temp_dir
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_local(ray_temp_dir: str) -> None:
    """A local Ray with 2 CPUs, started by the folder's first module that needs it and kept
    for the next ones (a start and a shutdown cost 4-5 s each time). A pp engine across two
    nodes is checked in tests/pipeline/two_node_job.py's cluster."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, _temp_dir=ray_temp_dir, include_dashboard=False, log_to_driver=False)


def shared_prefix_ids():
    """Token ids of prompts sharing long prefixes, and prefix groups over them."""
    tokenizer = load_tokenizer("smollm2")
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in shared_prefix_prompts()]
    ids = [p[:80] for p in ids]  # keep steps small on a shared 2-core box
    return ids, prefix_groups_for(ids)


@pytest.fixture(scope="package")
def prompts_and_groups():
    """shared_prefix_ids, once for the folder."""
    return shared_prefix_ids()


def engine_config(model_dir: Path, **overrides) -> EngineConfig:
    """Chunked prefill (chunk 7) with prefix caching, a small KV pool."""
    settings = dict(
        model=str(model_dir),
        dtype="float32",  # the exactness promise is checked in float32
        num_kv_blocks=128,
        chunk_size=7,
        max_num_batched_tokens=48,
        worker_num_cpus=0.25,
    )
    settings.update(overrides)
    return EngineConfig(**settings)


def run_engine(config: EngineConfig, prompts, groups, **engine_kwargs) -> list[tuple[int, ...]]:
    """Greedy tokens of every prompt (with the prefix groups) from a fresh engine."""
    with torch_threads(1):
        engine = LLMEngine(config, **engine_kwargs)
        try:
            outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), groups)
        finally:
            shutdown = getattr(engine.runner, "shutdown", None)
            if shutdown is not None:
                shutdown()
    assert all(o.finished and o.error is None for o in outputs)
    return [o.token_ids for o in outputs]


def assert_same_tokens(model_dir: Path, prompts, got, expected) -> None:
    """Token-identical, except after a demonstrated floating-point tie (the reference model
    is loaded only when there is a difference to show the tie of)."""
    from transformers import AutoModelForCausalLM

    pairs = list(zip(prompts, got, expected, strict=True))
    if all(list(g) == list(e) for _, g, e in pairs):
        return
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for ids, g, e in pairs:
        assert_greedy_match(reference, ids, g, e)


def steps_run(runner: Any) -> int:
    """The engine's step counter (a compiled graph's executor keeps the one counter)."""
    return int(getattr(runner, "executor", runner)._step)


def assert_killed_worker_fails_loudly(engine: LLMEngine, stage: int, rank: int, prompts, groups):  # noqa: ANN001
    """Kill worker (stage, rank) in the engine's third step from now: the step fails with a
    WorkerFailedError naming the worker and the step, the engine refuses further steps, and
    the placement group is released. No hang: the test's timeout is the guard (no wall-clock
    bound asserted)."""
    import ray

    from actors.parallel.errors import WorkerFailedError

    crash = steps_run(engine.runner) + 3
    ray.get(engine.runner.workers[stage][rank].crash_at_step.remote(crash))
    # With pp, step crash-1's reply may still be unsent when the worker exits (os._exit drops
    # it), so the engine can meet the death on that step, the one it was collecting.
    steps = f"({crash - 1}|{crash})" if len(engine.runner.workers) > 1 else str(crash)
    with pytest.raises(
        WorkerFailedError, match=f"stage {stage} tp rank {rank} failed in step {steps}\\b"
    ):
        engine.generate(prompts, SamplingParams(max_tokens=4), groups)
    with pytest.raises(WorkerFailedError, match="shut down"):  # no half-alive engine
        engine.step()
        engine.step()
    assert all(s["state"] == "REMOVED" for s in ray.util.placement_group_table().values())
