"""The sampler draws from the distribution vLLM defines, checked from first principles: token
frequencies over many draws equal softmax(logits / temperature), renormalised over what
top-k and top-p keep. The sampler's generator is seeded, so the draws (and the test) are
deterministic; the tolerance is over 5 standard errors."""

from __future__ import annotations

import pytest
import torch

from actors import SamplingParams
from actors.request import Request
from actors.sampler import Sampler

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
DRAWS = 8_000
TOL = 0.03  # a frequency's standard error is at most 0.0056 here


def frequencies(params: SamplingParams) -> torch.Tensor:
    sampler = Sampler(eos_token_ids=[], seed=0)
    requests = [Request(f"r{i}", [1, 2, 3], params) for i in range(DRAWS)]
    tokens = sampler(LOGITS.repeat(DRAWS, 1), requests).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).float() / DRAWS


def expected(temperature: float, keep: list[int]) -> torch.Tensor:
    scaled = LOGITS / temperature
    masked = torch.full_like(scaled, float("-inf"))
    masked[keep] = scaled[keep]
    return torch.softmax(masked, dim=-1)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_the_logits(temperature) -> None:  # noqa: ANN001
    got = frequencies(SamplingParams(temperature=temperature))
    torch.testing.assert_close(got, expected(temperature, [0, 1, 2, 3, 4]), atol=TOL, rtol=0)


def test_top_k_and_top_p_renormalise_what_they_keep() -> None:
    got = frequencies(SamplingParams(temperature=2.0, top_k=3))
    torch.testing.assert_close(got, expected(2.0, [0, 1, 2]), atol=TOL, rtol=0)
    # at T=1 the best two hold 0.49 + 0.18 = 0.67 of the mass: top_p 0.6 keeps them (the
    # smallest set reaching 0.6), top_p 0.4 only the best
    p = expected(1.0, [0, 1, 2, 3, 4])
    assert p[0] < 0.6 < p[0] + p[1]
    got = frequencies(SamplingParams(temperature=1.0, top_p=0.6))
    torch.testing.assert_close(got, expected(1.0, [0, 1]), atol=TOL, rtol=0)
    got = frequencies(SamplingParams(temperature=1.0, top_p=0.4))
    torch.testing.assert_close(got, expected(1.0, [0]), atol=TOL, rtol=0)
