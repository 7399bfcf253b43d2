"""Several samples per prompt (`SamplingParams.n`, `best_of`): one prefill, forked KV.

A prompt asked for k = `params.num_samples` > 1 sequences becomes k sample requests (ids
`f"{request_id}#{i}"`) that form one more prefix group, nested in the planner's deepest group
of that prompt: its shared prefix is the prompt but its last token. The group's prefix request
computes those tokens once, each sample takes its full blocks by reference and a copy of the
trailing partial block (the scheduler's copy-on-write, so no sample writes into a shared
block), computes the last prompt token and samples from it. So k samples cost one prefill plus
k tokens, and each sample's `num_cached_tokens` counts the shared part.

Outputs keep the caller's request id with `sample_index` 0..n-1. With best_of > n the samples
are held until all have finished, and the n with the highest cumulative logprob come out
(best first, re-indexed), as vLLM's best_of.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from actors.config import MAX_SEED, MIN_SEED, SamplingParams
from actors.outputs import RequestOutput
from actors.prefix_sharing import check_groups
from packing.prefix import PrefixGroup


def sample_id(request_id: str, index: int, num_samples: int) -> str:
    """The engine request id of sample `index` of the prompt `request_id`."""
    return request_id if num_samples == 1 else f"{request_id}#{index}"


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of sample `index` of a prompt: one sequence, seed + index (wrapped into the
    seed range) when seeded, logprobs on when best_of must rank the samples by them."""
    if params.num_samples == 1:
        return params
    seed = params.seed
    if seed is not None:
        seed = (seed + index - MIN_SEED) % (MAX_SEED - MIN_SEED + 1) + MIN_SEED
    logprobs = params.logprobs
    if logprobs is None and params.num_samples > params.n:
        logprobs = 0  # the sampled token's logprob only, for the cumulative logprob
    return dataclasses.replace(params, n=1, best_of=None, seed=seed, logprobs=logprobs)


@dataclass(frozen=True)
class Forked:
    """Prompts with their samples spelled out: row j is sample `sample_index[j]` of prompt
    `origin[j]`; `groups` are the planner's groups over those rows plus the samples' groups."""

    origin: list[int]
    sample_index: list[int]
    params: list[SamplingParams]
    groups: list[PrefixGroup]


def fork_samples(
    token_ids: list[list[int] | None],
    params: Sequence[SamplingParams],
    groups: Sequence[PrefixGroup],
    runnable: Callable[[list[int]], bool],
) -> Forked:
    """One row per sample of every prompt and the prefix groups over them (see the module
    docstring); `runnable(tokens)` is False for a prompt that ends in an error (no group).
    ValueError naming the group when the planner's groups do not fit the prompts."""
    prompts = [ids or [] for ids in token_ids]
    deepest = check_groups(prompts, groups)
    counts = [p.num_samples for p in params]
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    rows = [(i, s) for i, count in enumerate(counts) for s in range(count)]
    forked = [dataclasses.replace(g, members=tuple(_rows_of(g.members, starts))) for g in groups]
    for i, count in enumerate(counts):
        tokens, parent = token_ids[i], deepest.get(i)
        if count == 1 or tokens is None or not runnable(tokens):
            continue
        shared = len(tokens) - 1  # the last prompt token is each sample's own: it samples
        if shared < 1 or (parent is not None and groups[parent].prefix_len >= shared):
            continue
        members = tuple(range(starts[i], starts[i + 1]))
        forked.append(PrefixGroup(prefix_len=shared, members=members, parent=parent))
    return Forked(
        origin=[i for i, _ in rows],
        sample_index=[s for _, s in rows],
        params=[sample_params(params[i], s) for i, s in rows],
        groups=forked,
    )


def _rows_of(members: Sequence[int], starts: list[int]) -> list[int]:
    return [row for m in members for row in range(starts[m], starts[m + 1])]


@dataclass
class _Samples:
    params: SamplingParams
    request_ids: list[str]
    finished: list[RequestOutput] = dataclasses.field(default_factory=list)


class SampleBook:
    """The engine's prompts with several samples: their sample requests, and best_of's
    selection. Prompts with one sample are not in it; their outputs pass through."""

    def __init__(self) -> None:
        self._parents: dict[str, _Samples] = {}

    def add(self, request_id: str, params: SamplingParams) -> None:
        """Record a prompt's sample requests (only when it has more than one); ValueError
        for an id whose samples are still running."""
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        count = params.num_samples
        if count > 1:
            ids = [sample_id(request_id, i, count) for i in range(count)]
            self._parents[request_id] = _Samples(params, ids)

    def sample_ids(self, request_id: str) -> list[str]:
        """The engine request ids behind a caller's request id (itself when it has one)."""
        samples = self._parents.get(request_id)
        return [request_id] if samples is None else list(samples.request_ids)

    def outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """What the caller sees of a step's outputs: every sample as it goes, or with
        best_of > n nothing until its prompt's samples have all finished, then the best n."""
        shown: list[RequestOutput] = []
        for out in outputs:
            samples = self._parents.get(out.request_id)
            if samples is None:
                shown.append(out)
                continue
            if out.finished:
                samples.finished.append(out)
                if len(samples.finished) == len(samples.request_ids):
                    del self._parents[out.request_id]
            if samples.params.num_samples == samples.params.n:
                shown.append(out)
            elif len(samples.finished) == len(samples.request_ids):
                shown.extend(_best(samples.finished, samples.params))
        return shown


def _best(finished: list[RequestOutput], params: SamplingParams) -> list[RequestOutput]:
    """best_of's n outputs: highest cumulative logprob first, re-indexed 0..n-1; the logprobs
    that were computed only to rank them are dropped."""
    ranked = sorted(
        finished,
        key=lambda o: (
            o.cumulative_logprob is None,
            -(o.cumulative_logprob or 0.0),
            o.sample_index,
        ),
    )
    keep_logprobs = params.logprobs is not None
    return [
        dataclasses.replace(
            out, sample_index=rank, logprobs=out.logprobs if keep_logprobs else None
        )
        for rank, out in enumerate(ranked[: params.n])
    ]


def per_prompt_params(
    params: SamplingParams | Sequence[SamplingParams] | None,
    num_prompts: int,
    default: SamplingParams,  # the engine's (the model's generation defaults)
) -> list[SamplingParams]:
    """One SamplingParams per prompt: `params` for all (`default` when None) or one each."""
    if params is None or isinstance(params, SamplingParams):
        return [params or default] * num_prompts
    per_prompt = list(params)
    if len(per_prompt) != num_prompts:
        raise ValueError(
            f"params must be one SamplingParams or one per prompt: {num_prompts} "
            f"prompts, {len(per_prompt)} params"
        )
    return per_prompt
