"""Fixtures for engine tests: the SmolLM2 tokenizer and tiny models (fresh per engine)."""

from __future__ import annotations

import pytest
import torch

from actors import EngineConfig, LLMEngine
from actors.attention import available_backends
from actors.config import ATTENTION_BACKENDS
from actors.loader import load_tokenizer
from tests.actors.reference import torch_threads
from tests.tiny_models import tiny_model


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models run fastest on one thread (no OpenMP hand-offs), also on a busy machine."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded SmolLM2 tokenizer (the tiny models share its vocabulary)."""
    return load_tokenizer("smollm2")


def context_model(arch: str):
    """A tiny model whose next token really depends on the context (tests.tiny_models)."""
    return tiny_model(arch)


@pytest.fixture(scope="session")
def reference_models():
    """One tiny model per architecture, left on `sdpa`, for Hugging Face references."""
    return {arch: context_model(arch) for arch in ("llama", "qwen2", "mistral")}


@pytest.fixture
def make_engine(tokenizer):
    """Build an engine over a fresh tiny model (same weights as the reference's)."""

    def make(arch: str = "llama", **config) -> LLMEngine:
        config.setdefault("num_kv_blocks", 512)  # not 1 GB of blocks for a tiny model
        return LLMEngine(EngineConfig(**config), model=context_model(arch), tokenizer=tokenizer)

    return make


@pytest.fixture(params=[name for name in ATTENTION_BACKENDS if name != "auto"])
def attention_backend(request) -> str:
    """Each attention backend in turn; those this machine cannot run for the CPU float32
    test models (varlen needs CUDA, cpu_kernel a C compiler) are skipped."""
    if request.param not in available_backends("cpu", torch.float32):
        pytest.skip(f"attention backend {request.param!r} cannot run on CPU in float32 here")
    return request.param
