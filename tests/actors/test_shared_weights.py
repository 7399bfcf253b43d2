"""Two engines on one model in one process (`LLMEngine(weights_from=)`, as an engine actor runs
the engines after its first): stepped at once by two threads, each gives the tokens one
engine gives alone, with the weights loaded and packed once; sharing a model whose rope
keeps per-step state on its module, or an engine of another config, is refused."""

from __future__ import annotations

import threading

import pytest
import torch

from actors import EngineConfig, LLMEngine, SamplingParams
from tests.actors.conftest import context_model
from tests.actors.rope_models import rope_model

PARAMS = SamplingParams(max_tokens=16)


def _prompts(seed: int) -> list[list[int]]:
    """Token prompts of different lengths, half of them on a shared 40-token head."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(3, 4000, (40,), generator=gen).tolist()
    out = []
    for i, n in enumerate((5, 17, 33, 64, 9, 120, 48, 2)):
        tail = torch.randint(3, 4000, (n,), generator=gen).tolist()
        out.append(head + tail if i % 2 else tail)
    return out


def _tokens(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [out.token_ids for out in engine.generate(prompts, PARAMS)]


def _packed(model: torch.nn.Module) -> list[int]:
    """The ids of the linears' packed weights (empty on torch's linear backend)."""
    return [id(m._raypack_packed) for m in model.modules() if hasattr(m, "_raypack_packed")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("screen", ["on", "off"])
def test_two_engines_on_one_model_step_at_once_with_their_alone_tokens(
    tokenizer, dtype, screen
) -> None:
    config = EngineConfig(num_kv_blocks=256, lm_head_screen=screen)
    first = LLMEngine(config, model=context_model("llama").to(dtype), tokenizer=tokenizer)
    packed = _packed(first.model)
    second = LLMEngine(config, weights_from=first)
    assert second.model is first.model and second.tokenizer is first.tokenizer
    assert _packed(second.model) == packed  # packed once, by the first
    assert second.runner.kv_caches[0][0].data_ptr() != first.runner.kv_caches[0][0].data_ptr()
    head, twin = first.runner.screened_head, second.runner.screened_head
    assert (head is None) == (twin is None)
    if head is not None:
        assert twin is not head and twin.packed is head.packed and twin.stats is not head.stats

    sets = [_prompts(1), _prompts(2)]
    want = [_tokens(first, s) for s in sets]  # one engine, alone, one set after the other
    assert want[0] != want[1]
    got: list = [None, None]
    start = threading.Barrier(2)

    def run(i: int, engine: LLMEngine) -> None:
        start.wait()
        got[i] = [_tokens(engine, sets[i]) for _ in range(3)]

    threads = [threading.Thread(target=run, args=(i, e)) for i, e in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [[want[0]] * 3, [want[1]] * 3]


def test_weights_are_shared_only_where_each_step_leaves_the_model_as_it_was(tokenizer) -> None:
    config = EngineConfig(num_kv_blocks=64)
    longrope = LLMEngine(config, model=rope_model("phi3"), tokenizer=tokenizer)
    assert not longrope.shares_weights  # its rope's frequencies are set per step, on the model
    with pytest.raises(ValueError, match="weights_from"):
        LLMEngine(config, weights_from=longrope)
    plain = LLMEngine(config, model=context_model("llama"), tokenizer=tokenizer)
    assert plain.shares_weights
    with pytest.raises(ValueError, match="weights_from"):
        LLMEngine(EngineConfig(num_kv_blocks=128), weights_from=plain)  # another config
