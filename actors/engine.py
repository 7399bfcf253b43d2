"""LLMEngine: add requests, step (schedule, run, postprocess), read outputs.

`generate` is the offline entry point (a list of prompts in, finished outputs in input order
out, optionally with the planner's prefix groups); `add_request` / `step` / `abort_request`
serve streaming callers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from actors import loader
from actors.config import EngineConfig, SamplingParams
from actors.detokenizer import Detokenizer
from actors.kv_cache import KVCacheManager, kv_bytes_per_block
from actors.model_runner import ModelRunner, model_geometry
from actors.outputs import FinishReason, RequestOutput, TokenLogprob
from actors.request import PrefixGroupState, Request, RequestStatus
from actors.sampler import Sampler
from actors.scheduler import Scheduler, SchedulerOutput

if TYPE_CHECKING:
    from actors.parallel.executor import ParallelExecutor
    from packing.prefix import PrefixGroup

logger = logging.getLogger(__name__)

LOG_EVERY_STEPS = 100
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLMEngine:
    """One model, one paged KV pool, one scheduler. Not thread-safe; one caller drives it.

    `model` and `tokenizer` may be given (tests pass tiny models); otherwise both are loaded
    from `config.model`. The engine switches the model's attention to `raypack_paged`.
    """

    def __new__(cls, config: EngineConfig | None = None, **kwargs: Any) -> LLMEngine:
        """pp > 1 builds `actors.parallel.pipelined.PipelinedEngine` (steps overlap)."""
        if cls is LLMEngine and config is not None and config.pipeline_parallel_size > 1:
            from actors.parallel.pipelined import PipelinedEngine

            return super().__new__(PipelinedEngine)
        return super().__new__(cls)

    def __init__(
        self, config: EngineConfig | None = None, *, model: Any = None, tokenizer: Any = None
    ) -> None:
        self.config = config = config or EngineConfig()
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = _DTYPES[config.dtype or ("bfloat16" if device.startswith("cuda") else "float32")]
        if config.world_size > 1:  # workers load the weights; this is the skeleton only
            from actors.parallel.weights import check_shapes, meta_model

            if model is not None:
                raise ValueError(
                    "tensor/pipeline parallel engines load config.model; pass no model"
                )
            model = meta_model(config, dtype)
            check_shapes(model, config.tensor_parallel_size, config.pipeline_parallel_size)
        elif model is None:
            model = loader.load_model(config.model, dtype, device, config.trust_remote_code)
        if tokenizer is None:
            tokenizer = loader.load_tokenizer(config.model, config.trust_remote_code)
        self.tokenizer = tokenizer
        self.model = model
        num_blocks = config.num_kv_blocks or _blocks_from_memory(model, config)
        self.max_model_len = _max_model_len(model, config, num_blocks)
        self.vocab_size = model.config.get_text_config().vocab_size
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv)
        self.runner: ModelRunner | ParallelExecutor
        if config.world_size > 1:
            from actors.parallel.executor import ParallelExecutor

            self.runner = ParallelExecutor(config, num_blocks, dtype)
        else:
            self.runner = ModelRunner(model, config, num_blocks)
        self.sampler = Sampler(_eos_ids(model, tokenizer), seed=config.seed)
        self.detokenizer = Detokenizer(tokenizer)
        self._requests: dict[str, Request] = {}  # unfinished user requests
        self._pending: list[RequestOutput] = []  # finished outside a step (errors, aborts)
        self._next_id = 0
        self._stats = _StepStats()
        logger.info(
            "engine ready: %d KV blocks of %d tokens, max_model_len %d, budget %d tokens/step",
            num_blocks,
            config.block_size,
            self.max_model_len,
            config.max_num_batched_tokens,
        )

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; returns its id. A prompt that cannot run (empty, too long for the
        context, unknown token ids) finishes at once with `finish_reason="error"`."""
        return self._add(prompt, params, request_id, group=None).request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks (e.g. its client went away); unknown ids are
        ignored. Its final output (`finish_reason="abort"`) comes from the next `step`."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        self.scheduler.finish([req], "abort")
        self._finish_time(req)
        self._pending.append(self._output(req))

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running (or has an output not yet returned)."""
        return bool(self._requests or self._pending)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step: schedule, run the model, sample, postprocess. Returns one output per
        request that got a token or finished in this step."""
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        for req in self.scheduler.failed:
            outputs.append(self._retire(req))
        self.scheduler.failed.clear()
        if not sched.scheduled:
            return outputs
        started = time.perf_counter()
        sampling, logits = self.runner.execute(sched)
        self.scheduler.update_after_step(sched)
        sampled = self.sampler(logits, sampling)
        finished: dict[FinishReason, list[Request]] = {}
        for req, token_id, logprob in zip(
            sampling, sampled.token_ids, sampled.logprobs, strict=True
        ):
            reason = self._append(req, token_id, logprob)
            if reason is not None:
                finished.setdefault(reason, []).append(req)
            else:
                outputs.append(self._output(req))
        for reason, reqs in finished.items():
            self.scheduler.finish(reqs, reason)
            outputs.extend(self._retire(req) for req in reqs)
        self._stats.record(self, sched, time.perf_counter() - started)
        return outputs

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        prefix_groups: Sequence[PrefixGroup] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt to completion; outputs in input order.

        `prefix_groups` (from the planner) name prompts that share their first `prefix_len`
        tokens: the prefix is computed once and its KV blocks shared by the members. Groups
        may nest (`PrefixGroup.parent`, as `packing.prefix_forest` makes them): a nested
        group's prefix extends its parent's, computing only its own extra tokens, and each
        prompt starts from the deepest group that holds it.
        """
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams()] * len(prompts)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise ValueError(
                    f"params must be one SamplingParams or one per prompt: {len(prompts)} "
                    f"prompts, {len(per_prompt)} params"
                )
        token_ids = [self._tokenize(p) for p in prompts]
        groups = _plan_groups(token_ids, prefix_groups or (), self)
        ids: list[str | None] = [None] * len(prompts)
        queued: set[int] = set()
        for index in _planned_order(len(prompts), prefix_groups or ()):
            chain = []  # the prompt's groups not queued yet, innermost first
            group = groups.get(index)
            while group is not None and id(group) not in queued:
                chain.append(group)
                group = group.parent
            for group in reversed(chain):  # a shared prefix runs before its members
                self.scheduler.add(group.prefix)
                queued.add(id(group))
            req = self._add(token_ids[index], per_prompt[index], None, group)
            ids[index] = req.request_id
        results: dict[str, RequestOutput] = {}
        wanted = set(ids)
        while self.has_unfinished() and len(results) < len(wanted):
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    results[out.request_id] = out
        return [results[i] for i in ids if i is not None]

    # ---- internals ------------------------------------------------------------------------

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return [int(t) for t in prompt]

    def _add(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None,
        request_id: str | None,
        group: PrefixGroupState | None,
    ) -> Request:
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        elif request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        req = Request(request_id, self._tokenize(prompt), params or SamplingParams(), group=group)
        self.detokenizer.start(req)
        req.error = self._check_prompt(req.prompt_token_ids)
        if req.error is not None:
            assert group is None, "members with invalid prompts are left out of groups"
            req.status = RequestStatus.FINISHED
            req.finish_reason = "error"
            self._finish_time(req)
            self._pending.append(self._output(req))
            return req
        self._requests[request_id] = req
        self.scheduler.add(req)
        return req

    def _check_prompt(self, ids: list[int]) -> str | None:
        if not ids:
            return "prompt is empty"
        if len(ids) + 1 > self.max_model_len:
            return (
                f"prompt has {len(ids)} tokens; with one generated token that exceeds "
                f"max_model_len={self.max_model_len}"
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"token ids outside the vocabulary (size {self.vocab_size}): {bad[:5]}"
        return None

    def _append(
        self, req: Request, token_id: int, logprob: TokenLogprob | None
    ) -> FinishReason | None:
        """Add a sampled token; the finish reason when it ends the request."""
        req.append_token(token_id)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if req.logprobs is not None and logprob is not None:
            req.logprobs.append(logprob)
        params = req.params
        num_chars = len(self.detokenizer.update(req))
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in self.sampler.eos_token_ids:
                return "stop"
            if token_id in params.stop_token_ids:
                return "stop"
            if self.detokenizer.find_stop(req, num_chars):
                return "stop"
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _retire(self, req: Request) -> RequestOutput:
        self._requests.pop(req.request_id, None)
        self._finish_time(req)
        return self._output(req)

    @staticmethod
    def _finish_time(req: Request) -> None:
        if req.finished_time is None:
            req.finished_time = time.monotonic()

    def _output(self, req: Request) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            num_prompt_tokens=req.num_prompt_tokens,
            token_ids=tuple(req.token_ids[req.num_prompt_tokens :]),
            text=req.text,
            finished=req.finished,
            finish_reason=req.finish_reason,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            arrival_time=req.arrival_time,
            first_token_time=req.first_token_time,
            finished_time=req.finished_time,
            error=req.error,
            logprobs=tuple(req.logprobs) if req.logprobs is not None else None,
            prompt_token_ids=tuple(req.prompt_token_ids),
        )


class _StepStats:
    """Counts for the periodic summary log line."""

    def __init__(self) -> None:
        self.steps = 0
        self.tokens = 0
        self.seconds = 0.0

    def record(self, engine: LLMEngine, sched: SchedulerOutput, seconds: float) -> None:
        self.steps += 1
        self.tokens += sched.total_num_scheduled_tokens
        self.seconds += seconds
        if self.steps % LOG_EVERY_STEPS == 0:
            s = engine.scheduler
            logger.info(
                "step %d: %.0f tokens/s over the last %d steps, running %d, waiting %d, "
                "KV usage %.0f%%, preemptions %d",
                self.steps,
                self.tokens / max(self.seconds, 1e-9),
                LOG_EVERY_STEPS,
                len(s.running),
                len(s.waiting),
                100 * engine.kv.usage,
                s.num_preemptions,
            )
            self.tokens, self.seconds = 0, 0.0


def _blocks_from_memory(model: Any, config: EngineConfig) -> int:
    num_layers, num_kv_heads, head_dim = model_geometry(model)
    dtype = next(model.parameters()).dtype
    per_block = kv_bytes_per_block(num_layers, config.block_size, num_kv_heads, head_dim, dtype)
    return max(1, int(config.kv_cache_memory_gb * 2**30 // per_block))


def _max_model_len(model: Any, config: EngineConfig, num_blocks: int) -> int:
    """The context: the model's (or config's), never beyond the KV pool or a sliding window
    (this engine attends to the full context only)."""
    text = model.config.get_text_config()
    limit = config.max_model_len or getattr(text, "max_position_embeddings", None) or 2048
    window = getattr(text, "sliding_window", None)
    if window and getattr(text, "use_sliding_window", True) and window < limit:
        logger.warning("max_model_len capped to the sliding window (%d tokens)", window)
        limit = window
    return min(limit, num_blocks * config.block_size)


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (eos, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    return ids


def _planned_order(num_prompts: int, groups: Sequence[PrefixGroup]) -> list[int]:
    """Input order, except that a group's members run together at its first member's place,
    and inside it each nested group's members run together the same way (depth first)."""
    chains: dict[int, list[int]] = {}  # prompt -> its groups, outermost first
    for g, group in enumerate(groups):  # parents come first (checked by _plan_groups)
        if len(group.members) >= 2:
            for m in group.members:
                chains.setdefault(m, []).append(g)
    order: list[int] = []
    visited: set[int] = set()

    def visit(g: int, level: int) -> None:
        visited.add(g)
        for m in groups[g].members:
            chain = chains[m]
            if len(chain) == level + 1:
                order.append(m)
            elif chain[level + 1] not in visited:
                visit(chain[level + 1], level + 1)

    for index in range(num_prompts):
        chain = chains.get(index)
        if chain is None:
            order.append(index)
        elif chain[0] not in visited:
            visit(chain[0], 0)
    return order


def _plan_groups(
    token_ids: list[list[int]], groups: Sequence[PrefixGroup], engine: LLMEngine
) -> dict[int, PrefixGroupState]:
    """Validate prefix groups and create each one's internal prefix request; returns the
    deepest group of every grouped prompt."""
    deepest = _check_groups(token_ids, groups)
    # A group shares only when >= 2 of its members can run (prompts that will end in an
    # error row do not wait for a prefix); the others' rows fall to the nearest one above.
    runnable = [
        [m for m in group.members if engine._check_prompt(token_ids[m]) is None] for group in groups
    ]
    nearest: list[PrefixGroupState | None] = []  # per group: itself or the sharing one above
    for g, group in enumerate(groups):
        above = nearest[group.parent] if group.parent is not None else None
        if len(runnable[g]) < 2 or group.prefix_len < 1:
            nearest.append(above)
            continue
        prefix = token_ids[group.members[0]][: group.prefix_len]
        prefix_req = Request(f"prefix-{engine._next_id}", prefix, SamplingParams(), is_prefix=True)
        engine._next_id += 1
        state = PrefixGroupState(prefix=prefix_req, num_unfinished_members=0, parent=above)
        prefix_req.group = state
        if above is not None:
            above.num_unfinished_members += 1  # the nested prefix is a member of its parent
        nearest.append(state)
    of_prompt: dict[int, PrefixGroupState] = {}
    for m, g in deepest.items():
        shared = nearest[g]
        if shared is not None and engine._check_prompt(token_ids[m]) is None:
            of_prompt[m] = shared
            shared.num_unfinished_members += 1
    return of_prompt


def _check_groups(token_ids: list[list[int]], groups: Sequence[PrefixGroup]) -> dict[int, int]:
    """ValueError naming the group unless every group's members are prompt indices that
    share its prefix and nested groups nest; returns each grouped prompt's deepest group."""
    deepest: dict[int, int] = {}
    for g, group in enumerate(groups):
        members = tuple(group.members)
        parent = group.parent
        if parent is not None:
            if not 0 <= parent < g:
                raise ValueError(
                    f"prefix group {g}: parent {parent} must be an earlier group (0..{g - 1})"
                )
            if group.prefix_len <= groups[parent].prefix_len:
                raise ValueError(
                    f"prefix group {g}: prefix_len {group.prefix_len} must exceed its parent "
                    f"group {parent}'s {groups[parent].prefix_len}"
                )
            outside = sorted(set(members) - set(groups[parent].members))
            if outside:
                raise ValueError(
                    f"prefix group {g}: members {outside} are not members of its parent "
                    f"group {parent}"
                )
        for m in members:
            if not 0 <= m < len(token_ids):
                raise ValueError(f"prefix group {g}: member {m} is not a prompt index")
            if deepest.get(m) != parent:
                raise ValueError(
                    f"prompt {m} is in more than one prefix group (groups {deepest[m]} and "
                    f"{g}, not nested)"
                )
            deepest[m] = g
        prefix = token_ids[members[0]][: group.prefix_len] if members else []
        if len(prefix) < group.prefix_len or any(
            token_ids[m][: group.prefix_len] != prefix for m in members
        ):
            raise ValueError(
                f"prefix group {g}: members {members} do not all start with the same "
                f"{group.prefix_len} tokens"
            )
    return deepest
