"""Logit adjustments before sampling, in vLLM v1's order: `logit_bias`, then the repetition,
frequency and presence penalties (both change the argmax, so greedy rows take them too);
`min_p` comes after temperature (it only narrows random sampling).

Each function returns its input untouched when no row asks for its adjustment (the common
path costs a scan of the requests' parameters), else a new tensor: the caller's logits are
never written, so a failed call leaves nothing to restore.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from actors.request import Request


def apply_logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Add each request's `logit_bias` to its row (`logits` `[rows, vocab]`, one per request)."""
    rows: list[int] = []
    cols: list[int] = []
    biases: list[float] = []
    for i, req in enumerate(requests):
        for token_id, bias in req.params.logit_bias:
            rows.append(i)
            cols.append(token_id)
            biases.append(bias)
    if not rows:
        return logits
    index = (torch.tensor(rows), torch.tensor(cols))
    return logits.index_put(index, torch.tensor(biases, dtype=logits.dtype), accumulate=True)


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Repetition, frequency and presence penalties, as vLLM's `apply_penalties`: a token seen
    in the prompt or the output has its logit divided by `repetition_penalty` when positive,
    multiplied when not; then `frequency_penalty` times its count in the output and
    `presence_penalty` if it occurs there are subtracted."""
    rows = [i for i, r in enumerate(requests) if r.params.penalised]
    if not rows:
        return logits
    params = [requests[i].params for i in rows]
    sub = logits[rows]  # a copy, [len(rows), vocab]
    vocab = sub.shape[-1]
    counts = _token_counts([requests[i].output_token_ids for i in rows], vocab, sub.dtype)
    if any(p.repetition_penalty != 1.0 for p in params):
        prompts = [requests[i].prompt_token_ids for i in rows]
        seen = (counts > 0) | (_token_counts(prompts, vocab, sub.dtype) > 0)
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=sub.dtype)
        penalty = torch.where(seen, rep[:, None], torch.ones((), dtype=sub.dtype))
        sub = torch.where(sub > 0, sub / penalty, sub * penalty)
        # A penalty far from 1 (accepted up to float32's normal range, actors/config.py) can
        # push a logit past the dtype's range: saturate instead, so no row holds an infinity
        # (several +inf tie for the argmax; softmax of them is NaN).
        limit = torch.finfo(sub.dtype).max
        sub = sub.clamp(-limit, limit)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=sub.dtype)
    pres = torch.tensor([p.presence_penalty for p in params], dtype=sub.dtype)
    sub = sub - freq[:, None] * counts - pres[:, None] * (counts > 0).to(sub.dtype)
    return logits.index_copy(0, torch.tensor(rows), sub)


def apply_min_p(logits: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    """Set to -inf the logits of tokens whose probability is below min_p times the row's best
    token's (`logits` after temperature; min_p 0 keeps the row as it is)."""
    if not any(p > 0.0 for p in min_p):
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, dtype=probs.dtype)[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def _token_counts(
    sequences: Sequence[Sequence[int]], vocab: int, dtype: torch.dtype
) -> torch.Tensor:
    """`[len(sequences), vocab]` float counts of each token id in each sequence."""
    width = max((len(s) for s in sequences), default=0)
    padded = torch.full((len(sequences), width), vocab, dtype=torch.long)  # vocab: a spare bin
    for row, seq in enumerate(sequences):
        if seq:
            padded[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    counts = torch.zeros(len(sequences), vocab + 1, dtype=dtype)
    counts.scatter_add_(1, padded, torch.ones(padded.shape, dtype=dtype))
    return counts[:, :vocab]
