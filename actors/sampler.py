"""Pick the next token of every sampling request from its logits, vectorised where possible.

First `logit_bias` and the repetition, frequency and presence penalties adjust the rows
that ask for them (actors/penalties.py, in vLLM v1's order), so greedy rows take the argmax
of the adjusted logits. Greedy rows share one argmax. Random rows are scaled by temperature,
filtered by min_p, then by top-k and top-p in one sort, and drawn from p: a seeded request
by the exponential race (`argmax(p / q)`, q ~ Exp(1)) with its noise from its own
`torch.Generator`, so its tokens depend only on its seed, not on what else shares the batch;
the unseeded rows together by inverse CDF (one uniform per row from the sampler's generator,
`inverse_cdf_draw`), which costs a cumulative sum where the race costs a random number per
token of the vocabulary. Logprobs are of the raw model
distribution (vLLM's default), before bias, penalties, temperature and filters.

`sample_each` isolates failures: when the batched call raises, each request is sampled alone
and only those that raise again fail (a failed call leaves the logits and the requests'
generators as it found them, so the others draw what they would have drawn).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from actors.outputs import TokenLogprob
from actors.penalties import apply_logit_bias, apply_min_p, apply_penalties
from actors.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplerOutput:
    """Sampled token per request, and its logprobs when asked for."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    errors: dict[int, str] = field(default_factory=dict)  # row -> why it has no token


class Sampler:
    """Stateless apart from the generator for unseeded random requests."""

    def __init__(self, eos_token_ids: Iterable[int], seed: int = 0):
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self.generator = torch.Generator().manual_seed(seed)

    def sample_each(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """The batched call; if it raises, each request alone, and a request that raises
        again gets no token but an entry in `errors` (its token id is -1)."""
        try:
            return self(logits, requests)
        except Exception:  # noqa: BLE001 (one request's values must not fail the batch)
            logger.warning("batched sampling failed; sampling each request alone", exc_info=True)
        token_ids: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        errors: dict[int, str] = {}
        for i, req in enumerate(requests):
            try:
                one = self(logits[i : i + 1], [req])
            except Exception as exc:  # noqa: BLE001
                logger.exception("sampling request %s failed", req.request_id)
                errors[i] = f"sampling failed: {type(exc).__name__}: {exc}"
                token_ids.append(-1)
                logprobs.append(None)
            else:
                token_ids.extend(one.token_ids)
                logprobs.extend(one.logprobs)
        return SamplerOutput(token_ids, logprobs, errors)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """`logits` `[num_requests, vocab]` float32, one row per request (same order). When
        it raises, the logits and the seeded requests' generators are as before the call."""
        generators = [
            (r.generator, r.generator.get_state())
            for r in requests
            if r.generator is not None and not r.params.greedy
        ]
        masked: list[tuple[int, list[int], torch.Tensor]] = []
        try:
            return self._sample_rows(logits, requests, masked)
        except BaseException:
            for i, banned, values in masked:
                logits[i, banned] = values
            for generator, state in generators:
                generator.set_state(state)
            raise

    def _sample_rows(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        masked: list[tuple[int, list[int], torch.Tensor]],
    ) -> SamplerOutput:
        num = len(requests)
        logprobs: list[TokenLogprob | None] = [None] * num
        wanted = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[wanted], dim=-1) if wanted else None

        self._mask_until_min_tokens(logits, requests, masked)
        # Out of place when any row asks for them: the caller's logits stay as they were.
        logits = apply_penalties(apply_logit_bias(logits, requests), requests)
        tokens = torch.empty(num, dtype=torch.long)
        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        if len(greedy) == num:
            tokens = logits.argmax(dim=-1)
        else:
            if greedy:
                tokens[greedy] = logits[greedy].argmax(dim=-1)
            random = [i for i, r in enumerate(requests) if not r.params.greedy]
            tokens[random] = self._sample(logits[random], [requests[i] for i in random])
        token_list = tokens.tolist()

        if raw_logprobs is not None:
            for row, i in enumerate(wanted):
                logprobs[i] = _token_logprob(
                    raw_logprobs[row], token_list[i], requests[i].params.logprobs or 0
                )
        return SamplerOutput(token_list, logprobs)

    def _mask_until_min_tokens(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        masked: list[tuple[int, list[int], torch.Tensor]],
    ) -> None:
        """Ban EOS and stop tokens of requests short of min_tokens (in place); `masked`
        records what was overwritten."""
        for i, req in enumerate(requests):
            params = req.params
            if req.num_output_tokens >= params.min_tokens:
                continue
            banned = list(params.stop_token_ids)
            if not params.ignore_eos:
                banned.extend(self.eos_token_ids)
            if banned:
                masked.append((i, banned, logits[i, banned]))  # a copy
                logits[i, banned] = float("-inf")

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        vocab = logits.shape[-1]
        temperatures = [r.params.temperature for r in requests]
        if any(t != 1.0 for t in temperatures):  # dividing by 1 changes nothing: skip the pass
            logits = logits / torch.tensor(temperatures, dtype=logits.dtype)[:, None]
        logits = apply_min_p(logits, [r.params.min_p for r in requests])
        # Clamped to the vocabulary before a tensor holds it (any top_k is a valid request).
        top_k = [min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in requests]
        top_p = [r.params.top_p for r in requests]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            logits = apply_top_k_top_p(logits, torch.tensor(top_k), torch.tensor(top_p))
        probs = torch.softmax(logits, dim=-1)  # [num_random, vocab]
        tokens = torch.empty(len(requests), dtype=torch.long)
        seeded = [i for i, r in enumerate(requests) if r.generator is not None]
        unseeded = [i for i, r in enumerate(requests) if r.generator is None]
        if unseeded:
            rows = probs if not seeded else probs[unseeded]
            tokens[unseeded] = inverse_cdf_draw(rows, self.generator)
        for i in seeded:  # the exponential race on the request's own stream
            noise = torch.empty_like(probs[i]).exponential_(generator=requests[i].generator)
            tokens[i] = (probs[i] / noise).argmax()
        return tokens


def inverse_cdf_draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `probs` `[rows, vocab]` (non-negative, each row summing to about
    1): the first token whose cumulative probability exceeds a uniform draw scaled to the
    row's total. One random number per row, where the exponential race draws one per token
    (that noise was 239 ms of the race's ~370 ms at 256 rows x 49,152 tokens on one CPU
    thread); a token of probability 0 is never drawn. Tokens per row, `[rows]` long."""
    cdf = probs.cumsum(dim=-1)  # on CPU the running sum is kept in double
    total = cdf[:, -1:]
    target = torch.rand(total.shape, generator=generator, dtype=cdf.dtype) * total
    picked = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    over = picked >= probs.shape[-1]  # the product rounded up to the total itself
    if bool(over.any()):
        last = probs.shape[-1] - 1 - (probs[over].flip(-1) > 0).to(torch.uint8).argmax(dim=-1)
        picked[over] = last
    return picked


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf.

    `logits` `[rows, vocab]`; `top_k` `[rows]` (vocab = off); `top_p` `[rows]` (1 = off).
    The nucleus keeps the smallest set of best tokens whose probability reaches top_p, and
    always the best token.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [rows, vocab]
    ranks = torch.arange(logits.shape[-1])
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    outside = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _token_logprob(row: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    top: tuple[tuple[int, float], ...] = ()
    if num_top > 0:
        values, ids = row.topk(num_top)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token_id=token_id, logprob=float(row[token_id]), top=top)
