"""LLMEngine: add requests, step (schedule, run, postprocess), read outputs.

`generate` is the offline entry point (a list of prompts in, finished outputs in input order
out, optionally with the planner's prefix groups); `add_prompts` queues such a list without
running it (a caller steps); `add_request` / `step` / `abort_request` serve streaming callers.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from actors import generation_defaults, limits
from actors.build_thread import BuildThread
from actors.config import EngineConfig, SamplingParams
from actors.detokenizer import Detokenizer
from actors.engine_setup import load_for_engine
from actors.guided import GuidedDecoder
from actors.model_runner import ModelRunner, StepRunner
from actors.outputs import FinishReason, RequestOutput, TokenLogprob
from actors.prompt_queue import PromptQueue, _describe
from actors.request import Request
from actors.rope import RopePolicy
from actors.sampler import Sampler, SamplerOutput
from actors.samples import SampleBook, per_prompt_params
from actors.scheduler import SchedulerOutput
from actors.screened_head import GreedyTokens
from actors.stats import EngineStats, StepStats
from actors.virtual_schedulers import VirtualSchedulers
from packing.step_budget import StepBudgetController

if TYPE_CHECKING:
    from actors.loader import ResolvedModel
    from packing.prefix import PrefixGroup

logger = logging.getLogger(__name__)


class LLMEngine(PromptQueue):
    """One model, one paged KV pool, a scheduler per request set, an executor. Not
    thread-safe; one caller drives it.

    Each step is schedule -> execute -> postprocess. The executor (`self.runner`) is chosen
    once from the config: a `ModelRunner` in this process, or tensor/pipeline-parallel Ray
    workers (`actors.parallel`), which with pp > 1 keep pp steps in flight, one per request
    set. `model` and `tokenizer` may be given (tests pass tiny models); otherwise both are
    loaded from `config.model`. The engine switches the model's attention to `raypack_paged`.
    How prompts become requests (tokenized, checked, forked into samples and prefix groups,
    queued or rejected): `PromptQueue` (actors/prompt_queue.py).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        model: Any = None,
        tokenizer: Any = None,
        compiled_graph: bool | None = None,
        resolved_model: ResolvedModel | None = None,
        weights_from: LLMEngine | None = None,
    ) -> None:
        """`compiled_graph` (pp > 1 only): True runs steps through a Ray compiled graph, False
        through one Ray task per worker per step, None chooses (`actors.parallel.pipelined`).
        `resolved_model`: `config.model` as the caller resolved it (`actors.loader`).
        `weights_from`: an engine of the same config in this process whose model, tokenizer
        and packed weights this one runs on (`shares_weights` says which can), with a KV
        pool, scheduler and sampler of its own: two engines stepped by two threads of one
        process hold the weights once."""
        self.config = config = config or EngineConfig()
        self._build_thread = BuildThread()  # warns if another thread steps it (see there)
        shared: ModelRunner | None = None
        if weights_from is not None:
            if not weights_from.shares_weights or weights_from.config != config:
                raise ValueError(
                    "weights_from: an engine of the same config, one process, no length-"
                    "dependent rope"
                )
            assert isinstance(weights_from.runner, ModelRunner)  # `shares_weights` says so
            shared = weights_from.runner
            model, tokenizer = shared.model, weights_from.tokenizer
        model, tokenizer, dtype = load_for_engine(config, model, tokenizer, resolved_model)
        self.tokenizer = tokenizer
        self.model = model
        self.rope = RopePolicy.of(model)  # None unless the rope depends on the length
        num_blocks = config.num_kv_blocks or limits.blocks_from_memory(model, config)
        self.max_model_len = limits.max_model_len(model, config, num_blocks)
        self.vocab_size = model.config.get_text_config().vocab_size
        # The executor, chosen once from the config: this process, or tp x pp Ray workers.
        self.runner: StepRunner
        if config.world_size > 1:
            from actors.parallel.pipelined import start_executor

            self.runner = start_executor(
                config, num_blocks, dtype, compiled_graph, rope=self.rope is not None
            )
        elif compiled_graph:
            raise ValueError("compiled_graph needs pipeline_parallel_size > 1")
        else:
            self.runner = ModelRunner(model, config, num_blocks, weights_of=shared)
        # One request set per step that can be in flight, each with its own slice of the
        # KV pool (pp sets for a pipeline-parallel engine, else one).
        sets = self.runner.max_in_flight
        self.blocks_per_set = num_blocks // sets
        if self.blocks_per_set < 1:
            self.runner.shutdown()
            raise ValueError(f"{num_blocks} KV blocks cannot be split into {sets} sets")
        self.scheduler = VirtualSchedulers(config, self.blocks_per_set, sets)
        self.kv = self.scheduler.kvs[0]  # the KV pool (the first set's when there are several)
        self.max_model_len = min(self.max_model_len, self.blocks_per_set * config.block_size)
        self._in_flight: deque[tuple[int, SchedulerOutput, Any, float]] = deque()
        self._next_set = 0
        self._last_step_end = 0.0
        self.sampler = Sampler(limits.eos_token_ids(model, tokenizer), seed=config.seed)
        # The model's own sampling defaults (actors/generation_defaults.py), for callers that
        # build requests field by field (Serve's unset fields); `default_params` for a request
        # without params, as vLLM's LLM.generate without sampling_params.
        self.sampling_defaults, self.default_params = generation_defaults.engine_defaults(
            model, config
        )
        self.detokenizer = Detokenizer(tokenizer)
        self.guided = GuidedDecoder(tokenizer, self.vocab_size, self.sampler.eos_token_ids)
        self._requests: dict[str, Request] = {}  # unfinished user requests
        self._samples = SampleBook()  # prompts with several samples (SamplingParams.n)
        self._pending: list[RequestOutput] = []  # finished outside a step (errors, aborts)
        self._next_id = 0
        self._stats = StepStats()
        # The step budget: fixed (None), or moved towards a TPOT target (packing/step_budget.py).
        budget_config = config.step_budget_config()
        self.step_budget = StepBudgetController(budget_config) if budget_config else None
        logger.info(
            "engine ready: %d KV blocks of %d tokens, max_model_len %d, budget %d tokens/step%s",
            num_blocks,
            config.block_size,
            self.max_model_len,
            config.max_num_batched_tokens,
            "" if budget_config is None else f" at most, aimed at TPOT {config.tpot_target_s}s",
        )

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; returns its id. A text prompt is tokenized as `tokenizer(prompt)`
        (actors/tokenization.py: the tokenizer's special tokens included). A prompt that cannot run (empty, too long for the
        context, unknown token ids) finishes at once with `finish_reason="error"`. With
        `params.n` > 1 its samples share one prefill (actors/samples.py); their outputs carry
        this id and `sample_index`."""
        if params is not None and params.num_samples > 1:
            return self._queue([prompt], [params], (), request_id)[0]
        return self._add(prompt, params, request_id, group=None).request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks (e.g. its client went away); unknown ids are
        ignored. Its final output (`finish_reason="abort"`) comes from the next `step`."""
        for rid in self._samples.sample_ids(request_id):
            req = self._requests.pop(rid, None)
            if req is None:
                continue
            self.scheduler.finish([req], "abort")  # a step in flight skips it when it returns
            self.guided.finish(rid)
            self._finish_time(req)
            self._pending.append(req.to_output())

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running (or has an output not yet returned,
        or a step in flight)."""
        return bool(self._requests or self._pending or self._in_flight)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block, as vLLM's `LLM.reset_prefix_cache`; only while
        no request is unfinished (returns False and changes nothing otherwise)."""
        return not self.has_unfinished() and self.scheduler.reset_prefix_cache()

    @property
    def shares_weights(self) -> bool:
        """Whether another engine can run on this one's weights (`weights_from`): a model in
        this process (not tp x pp workers') whose rope keeps no per-step state."""
        return isinstance(self.runner, ModelRunner) and self.runner.rotary is None

    @property
    def stats(self) -> EngineStats:
        """Steps run, tokens computed and preemptions since the engine was built (a copy)."""
        return self._stats.snapshot(self.scheduler.num_preemptions)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step: schedule, run the model, sample, postprocess. Returns one output per
        request that got a token or finished in this step.

        With several request sets (pp > 1) the step keeps one step of each set in flight:
        it submits a step for every idle set with work, then collects the oldest, samples it
        and submits that set's next step before returning, so the stages overlap."""
        self._build_thread.check()
        outputs, self._pending = self._pending, []
        self._fill(outputs)
        if not self._in_flight:
            return self._samples.outputs(outputs)
        index, sched, handle, submitted = self._in_flight.popleft()
        started = max(submitted, self._last_step_end)  # overlapping steps counted once
        sampling, logits = self.runner.collect(handle)
        self.scheduler.schedulers[index].update_after_step(sched)
        self._apply_samples(sampling, logits, outputs)
        self._last_step_end = time.perf_counter()
        seconds = self._last_step_end - started
        self._stats.record(sched, seconds, self.scheduler)
        if self.step_budget is not None:
            self.step_budget.observe(
                seconds, sched.token_budget, sched.total_num_scheduled_tokens, sched.num_decodes
            )
        if self.runner.max_in_flight > 1:
            self._fill(outputs)  # the set just sampled can go again before we wait
        return self._samples.outputs(outputs)

    def _fill(self, outputs: list[RequestOutput]) -> None:
        """Schedule and submit a step for each idle request set with work, in turn, up to the
        executor's `max_in_flight` (with one set: the next step, run at once in process)."""
        count = len(self.scheduler.schedulers)
        busy = {index for index, _, _, _ in self._in_flight}
        for offset in range(count):
            if len(self._in_flight) >= self.runner.max_in_flight:
                return
            index = (self._next_set + offset) % count
            scheduler = self.scheduler.schedulers[index]
            if index in busy or not scheduler.has_unfinished():
                continue
            budget = None
            if self.step_budget is not None:
                budget = self.step_budget.budget(scheduler.num_decodes)
            sched = scheduler.schedule(budget)
            for req in scheduler.failed:
                self.scheduler.release(req.request_id)
                outputs.append(self._retire(req))
            scheduler.failed.clear()
            if not sched.scheduled:
                continue
            submitted = time.perf_counter()
            handle = self.runner.submit(sched, index * self.blocks_per_set)
            self._in_flight.append((index, sched, handle, submitted))
            busy.add(index)
            self._next_set = (index + 1) % count

    def _apply_samples(
        self,
        sampling: list[Request],
        logits: torch.Tensor | GreedyTokens,
        outputs: list[RequestOutput],
    ) -> None:
        """Sample one token per request, append it, and retire the requests that stop
        (freed in their request set); an output per request that got a token.
        A request whose sampling or postprocessing raises ends alone with an error."""
        if isinstance(logits, GreedyTokens):  # a screened step: plain greedy rows only
            tokens = logits.token_ids.tolist()
            sampled = SamplerOutput(tokens, [None] * len(tokens))
        else:
            self.guided.apply(logits, sampling)  # grammars' masks first, greedy and random
            sampled = self.sampler.sample_each(logits, sampling)
        finished: dict[FinishReason, list[Request]] = {}
        for row, (req, token_id, logprob) in enumerate(
            zip(sampling, sampled.token_ids, sampled.logprobs, strict=True)
        ):
            if req.finished:  # aborted while its step was in flight
                continue
            error = sampled.errors.get(row)
            if error is None:
                reason = self._append_or_fail(req, token_id, logprob)
            else:
                req.error, reason = error, "error"
            if reason is not None:
                finished.setdefault(reason, []).append(req)
            else:
                outputs.append(req.to_output())
                self._restart_if_rope_changes(req)
        for reason, reqs in finished.items():
            self.scheduler.finish(reqs, reason)
            outputs.extend(self._retire(req) for req in reqs)

    def add_prompts(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        prefix_groups: Sequence[PrefixGroup] | None = None,
    ) -> list[str]:
        """Queue every prompt (with the planner's prefix groups) without running them; returns
        their request ids in input order. `step` runs them, alongside any other requests: a
        caller can queue the next batch while this one decodes (the offline job does).

        `prefix_groups` (from the planner) name prompts that share their first `prefix_len`
        tokens: the prefix is computed once and its KV blocks shared by the members. Groups
        may nest (`PrefixGroup.parent`, as `packing.prefix_forest` makes them): a nested
        group's prefix extends its parent's, computing only its own extra tokens, and each
        prompt starts from the deepest group that holds it. None: the engine plans them over
        these prompts (`EngineConfig.plan_prefix_groups`; an empty list: no groups). A prompt
        with `n` (or `best_of`) > 1 is queued as that many samples in a group of their own
        (actors/samples.py).
        """
        if prefix_groups is None and not self.config.plan_prefix_groups:
            prefix_groups = ()
        return self._queue(
            prompts,
            per_prompt_params(params, len(prompts), self.default_params),
            prefix_groups,
            None,
        )

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        prefix_groups: Sequence[PrefixGroup] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt to completion (`add_prompts`, then `step` until they
        finish); outputs in input order, a prompt's `n` samples one after the other."""
        per_prompt = per_prompt_params(params, len(prompts), self.default_params)
        ids = self.add_prompts(prompts, per_prompt, prefix_groups)
        wanted = {rid: p.n for rid, p in zip(ids, per_prompt, strict=True)}
        results: dict[tuple[str, int], RequestOutput] = {}
        while self.has_unfinished() and len(results) < sum(wanted.values()):
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    results[out.request_id, out.sample_index] = out
        return [results[rid, s] for rid in ids for s in range(wanted[rid])]

    # ---- internals ------------------------------------------------------------------------

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
        if self.guided.accept(req, token_id):
            return "stop"  # the grammar is complete (its stop token accepted)
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

    def _append_or_fail(
        self, req: Request, token_id: int, logprob: TokenLogprob | None
    ) -> FinishReason | None:
        """`_append`; when it raises (detokenizing, a stop check), the request ends with an
        error and the step goes on for the others."""
        try:
            return self._append(req, token_id, logprob)
        except Exception as exc:  # noqa: BLE001 (this request's fault; the engine goes on)
            logger.exception("postprocessing a token of request %s failed", req.request_id)
            req.error = f"postprocessing a generated token failed: {_describe(exc)}"
            return "error"

    def _restart_if_rope_changes(self, req: Request) -> None:
        """Phi-3's `generate` recomputes a sequence that first grows past its original
        context with the long rope factors (actors/rope.py): so does the engine."""
        rope = self.rope
        if rope is not None and rope.restarts(
            req.num_tokens, req.num_computed_tokens, req.rope_len
        ):
            rope_len = req.num_tokens
            scheduler = self.scheduler.schedulers[self.scheduler.owner(req)]
            scheduler.restart(req, rope_len, rope.cache_salt(rope_len))

    def _retire(self, req: Request) -> RequestOutput:
        self._requests.pop(req.request_id, None)
        self.guided.finish(req.request_id)
        self._finish_time(req)
        return req.to_output()
