"""Hugging Face references for the engine's exactness tests, and the tie-aware comparison."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts.jsonl"  # see tests/data/README.md
TIE_GAP = 1e-4  # a top-2 logit gap below this is a floating-point tie, not an engine bug


@contextmanager
def torch_threads(num: int) -> Iterator[None]:
    """Run a block with `num` torch threads (tiny models: 1 beats 2, above all on a busy box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(num)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@torch.inference_mode()
def hf_greedy(model, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from `model.generate` on this prompt alone (stops at EOS like the engine)."""
    device = next(model.parameters()).device
    out = model.generate(
        torch.tensor([list(prompt_ids)], device=device),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=model.config.pad_token_id or 0,
    )
    return out[0, len(prompt_ids) :].tolist()


@torch.inference_mode()
def top2_gap(model, ids: Sequence[int]) -> float:
    """Gap between the best two next-token logits of `ids` (a solo forward)."""
    device = next(model.parameters()).device
    logits = model(torch.tensor([list(ids)], device=device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_greedy_match(
    reference_model,
    prompt_ids: Sequence[int],
    got: Sequence[int],
    expected: Sequence[int],
    tie_gap: float = TIE_GAP,
) -> bool:
    """Tokens must equal the reference's; a difference is allowed only at a logit tie.

    At the first differing token the reference's top-2 gap must be below `tie_gap` (the tie is
    shown, not assumed); after it the sequences may legitimately part. Returns True when
    identical.
    """
    got, expected = list(got), list(expected)
    if got == expected:
        return True
    first = next(
        (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
        min(len(got), len(expected)),
    )
    if first == min(len(got), len(expected)):
        raise AssertionError(f"lengths differ with a common prefix: got {got}, expected {expected}")
    gap = top2_gap(reference_model, list(prompt_ids) + expected[:first])
    assert gap < tie_gap, (
        f"token {first} differs (got {got[first]}, reference {expected[first]}) and the "
        f"reference's top-2 logit gap there is {gap:.3g}, not a tie"
    )
    return False


def sample_prompts(count: int, start: int = 0) -> list[str]:
    """`count` real user requests from the bundled HH-RLHF sample, from position `start`."""
    with open(PROMPTS, encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    if start + count > len(prompts):
        raise ValueError(
            f"tests/data/prompts.jsonl holds {len(prompts)} prompts, not {start + count}"
        )
    return prompts[start : start + count]
