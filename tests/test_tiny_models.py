"""The tiny test models depend on their whole context, on the prompts the token-comparing
tests use: with every layer's attention output zeroed the next token can only depend on the
last token, and the greedy output must then change on every prompt; so must it when the
prompt's tokens are reversed. Hugging Face `generate` only (no raypack code runs)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from actors.loader import load_tokenizer
from tests.actors.groups import shared_prefix_prompts
from tests.actors.reference import hf_greedy, top2_gap, torch_threads
from tests.pipeline.data import MALFORMED, TEMPLATE, rows
from tests.tiny_models import tiny_model

SERVE_PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
MAX_TOKENS = 6
MIN_GAP = 2e-5  # every greedy choice's top-2 logit gap is well above float32 noise (~1e-6)


@contextmanager
def attention_zeroed(model) -> Iterator[None]:  # noqa: ANN001
    """Every layer's attention output replaced by zeros while the block runs."""

    def zero(_module, _inputs, output):  # noqa: ANN001, ANN202
        return (torch.zeros_like(output[0]), *output[1:])

    hooks = [layer.self_attn.register_forward_hook(zero) for layer in model.model.layers]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def prompt_sets() -> dict[str, list[str]]:
    """The prompts of tests/pipeline (the job's table), tests/serve and tests/actors+parallel."""
    pipeline = [TEMPLATE.format(**r) for r in rows() if r["id"] not in MALFORMED]
    return {"pipeline": pipeline, "serve": SERVE_PROMPTS, "engine": shared_prefix_prompts()}


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return load_tokenizer("smollm2")


@pytest.mark.parametrize(
    ("arch", "num_layers", "sets"),
    [
        ("llama", 2, ("pipeline", "serve", "engine")),  # pipeline, serve, actors, parallel
        ("llama", 4, ("engine",)),  # tests/parallel's pipeline-parallel model
        ("qwen2", 2, ("engine",)),
        ("mistral", 2, ("engine",)),
    ],
)
def test_zeroed_attention_changes_every_greedy_output(tokenizer, arch, num_layers, sets) -> None:  # noqa: ANN001
    model = tiny_model(arch, num_layers=num_layers)
    with torch_threads(1):
        for name in sets:
            prompts = [tokenizer.encode(p, add_special_tokens=False) for p in prompt_sets()[name]]
            normal = [hf_greedy(model, ids, MAX_TOKENS) for ids in prompts]
            with attention_zeroed(model):
                blind = [hf_greedy(model, ids, MAX_TOKENS) for ids in prompts]
            same = [i for i, (a, b) in enumerate(zip(normal, blind, strict=True)) if a == b]
            assert not same, f"{arch}/{name}: prompts {same} give the same tokens without attention"
            # and the choices are not floating-point coin flips
            gaps = [
                top2_gap(model, ids + out[:k])
                for ids, out in zip(prompts, normal, strict=True)
                for k in range(len(out))
            ]
            assert min(gaps) > MIN_GAP, (arch, name, min(gaps))


def test_reversed_prompt_changes_every_greedy_output(tokenizer) -> None:  # noqa: ANN001
    """The same tokens reversed (the last kept last): another output, so order matters."""
    model = tiny_model("llama")
    with torch_threads(1):
        for name, texts in prompt_sets().items():
            prompts = [tokenizer.encode(p, add_special_tokens=False) for p in texts]
            prompts = [ids for ids in prompts if len(set(ids)) > 1]
            normal = [hf_greedy(model, ids, MAX_TOKENS) for ids in prompts]
            flipped = [hf_greedy(model, ids[-2::-1] + ids[-1:], MAX_TOKENS) for ids in prompts]
            same = [i for i, (a, b) in enumerate(zip(normal, flipped, strict=True)) if a == b]
            assert not same, f"{name}: prompts {same} give the same tokens reversed"
