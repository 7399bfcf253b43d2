"""Shared cases for the end-to-end sampling tests (Serve over HTTP, the offline job): prompts
with known behaviour on tests.tiny_models' llama, and first-principles greedy references.

`EOS_PROMPT`'s greedy continuation ends with the end-of-sequence token (id 2) as its fifth
token, found by searching one-token prompts; the tests check that precondition with Hugging
Face `generate` before relying on it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

EOS_ID = 2
EOS_PROMPT = " toddler"
EOS_AT = 4  # index of the EOS token in EOS_PROMPT's greedy continuation
STOP_PROMPT = "The capital of France is"


@torch.inference_mode()
def greedy_loop(
    model,  # noqa: ANN001
    prompt_ids: Sequence[int],
    max_tokens: int,
    *,
    eos_stops: bool = True,
    min_tokens: int = 0,
) -> list[int]:
    """Greedy decoding by full forward passes (no cache, no `generate`): with eos_stops the
    EOS token ends it (and is kept), before min_tokens tokens EOS is never chosen."""
    ids = list(prompt_ids)
    out: list[int] = []
    while len(out) < max_tokens:
        logits = model(torch.tensor([ids + out])).logits[0, -1].float()
        if len(out) < min_tokens:
            logits[EOS_ID] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        if token == EOS_ID and eos_stops:  # never before min_tokens: banned above
            break
    return out


def stop_string(text: str) -> str:
    """A 3-character piece of `text` from its middle whose first occurrence is there (so the
    expected cut is text[: text.index(piece)]) and not at the start."""
    for start in range(len(text) // 2, len(text) - 3):
        piece = text[start : start + 3]
        if piece.strip() and text.index(piece) == start:
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


def tokens_until(tokenizer, token_ids: Sequence[int], stop: str) -> int:  # noqa: ANN001
    """How many tokens are generated when `stop` first appears in the decoded text."""
    for k in range(1, len(token_ids) + 1):
        if stop in tokenizer.decode(list(token_ids[:k]), skip_special_tokens=True):
            return k
    raise AssertionError(f"{stop!r} never appears")


def adjust_by_hand(logits: torch.Tensor, prompt: Sequence[int], out: Sequence[int], params):  # noqa: ANN001, ANN201
    """`params`' logit_bias, then its repetition, frequency and presence penalties (vLLM's
    order and formulas), one token at a time in plain Python."""
    logits = logits.clone()
    for token, bias in params.logit_bias:
        logits[token] += bias
    for token in set(prompt) | set(out):
        value = float(logits[token])
        r = params.repetition_penalty
        logits[token] = value / r if value > 0 else value * r
    for token, count in Counter(out).items():
        logits[token] -= params.frequency_penalty * count + params.presence_penalty
    return logits


@torch.inference_mode()
def penalised_greedy(model, prompt: Sequence[int], params) -> tuple[list[int], list[float]]:  # noqa: ANN001
    """Greedy tokens under `params` (bias and penalties by `adjust_by_hand`) by full forward
    passes, EOS not stopping, and each step's top-2 gap of the adjusted logits."""
    prompt = list(prompt)
    out: list[int] = []
    gaps: list[float] = []
    for _ in range(params.max_tokens):
        raw = model(torch.tensor([prompt + out])).logits[0, -1].float()
        top = adjust_by_hand(raw, prompt, out, params).topk(2)
        gaps.append(float(top.values[0] - top.values[1]))
        out.append(int(top.indices[0]))
    return out, gaps
