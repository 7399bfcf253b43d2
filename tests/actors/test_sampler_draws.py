"""The sampler's draws: a seeded request's tokens are exactly the exponential race on its own
seed's stream (what the sampler drew before unseeded rows moved to inverse CDF), whatever
shares its batch; the inverse-CDF draw never picks a token of probability 0. (Frequencies of
unseeded draws: tests/actors/test_sampling_distribution.py.)"""

from __future__ import annotations

import pytest
import torch

from actors import SamplingParams
from actors.request import Request
from actors.sampler import Sampler, apply_top_k_top_p, inverse_cdf_draw

VOCAB = 2_000
STEPS = 6


def race_reference(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """The sampler's draw for seeded random rows before the change (copied from it): scale,
    filter, softmax over the random rows, the exponential race with each row's generator."""
    temperature = torch.tensor([r.params.temperature for r in requests], dtype=logits.dtype)
    scaled = logits / temperature[:, None]
    top_k = [min(r.params.top_k, VOCAB) if r.params.top_k > 0 else VOCAB for r in requests]
    top_p = [r.params.top_p for r in requests]
    if any(k < VOCAB for k in top_k) or any(p < 1.0 for p in top_p):
        scaled = apply_top_k_top_p(scaled, torch.tensor(top_k), torch.tensor(top_p))
    probs = torch.softmax(scaled, dim=-1)
    noise = torch.empty_like(probs)
    for i, request in enumerate(requests):
        assert request.generator is not None
        noise[i].exponential_(generator=request.generator)
    return (probs / noise).argmax(dim=-1).tolist()


def test_seeded_rows_are_the_exponential_race_of_their_seed_in_any_batch() -> None:
    torch.manual_seed(0)
    seeded_params = [
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.7, seed=2**64 - 1),
        SamplingParams(temperature=1.3, top_k=40, seed=5),
        SamplingParams(temperature=1.0, top_p=0.9, seed=-3),
    ]
    others = [SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(top_k=7)]
    batch = [Request(f"s{i}", [1, 2], p) for i, p in enumerate(seeded_params)]
    mixed = batch[:2] + [Request(f"o{i}", [1, 2], p) for i, p in enumerate(others)] + batch[2:]
    reference = [Request(f"r{i}", [1, 2], p) for i, p in enumerate(seeded_params)]
    sampler = Sampler(eos_token_ids=[], seed=0)
    for _ in range(STEPS):
        seeded_logits = torch.randn(len(batch), VOCAB) * 3
        other_logits = torch.randn(len(others), VOCAB) * 3
        logits = torch.cat([seeded_logits[:2], other_logits, seeded_logits[2:]])
        got = sampler(logits, mixed).token_ids
        expected = race_reference(seeded_logits.clone(), reference)
        assert got[:2] + got[-2:] == expected


def test_inverse_cdf_draws_only_tokens_with_probability() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    generator = torch.Generator().manual_seed(0)
    seen = {0: set(), 1: set()}
    for _ in range(200):
        for row, token in enumerate(inverse_cdf_draw(probs, generator).tolist()):
            seen[row].add(token)
    assert seen == {0: {1, 3}, 1: {4}}


def test_a_draw_rounded_up_to_the_total_takes_the_last_token_with_probability(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def rand_one(shape: torch.Size, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
        return torch.ones(shape, dtype=dtype)  # as if u * total rounded up to total

    monkeypatch.setattr(torch, "rand", rand_one)
    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0], [0.2, 0.3, 0.1, 0.4]])
    assert inverse_cdf_draw(probs, torch.Generator()).tolist() == [1, 3]
