"""Fixtures for engine tests: the SmolLM2 tokenizer and tiny models (fresh per engine)."""

from __future__ import annotations

import pytest
import torch

from actors import EngineConfig, LLMEngine
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
    """A tiny model whose next token really depends on the context.

    tests.tiny_models' default init leaves attention's contribution to the logits around
    1e-3 (the wide embeddings dominate the residual stream), so a wrong attention mask could
    still give the right tokens. Layer matrices drawn with std 0.2 make the context move the
    logits by about 0.5, so token comparisons test the attention paths.
    """
    model = tiny_model(arch)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.model.layers.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.2, generator=generator)
    return model


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
