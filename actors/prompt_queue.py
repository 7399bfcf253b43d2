"""How a prompt becomes the engine's queued requests (`PromptQueue`, a part of `LLMEngine`):
tokenized, checked (empty, too long for the context, token ids or logit_bias outside the
vocabulary, a grammar that does not compile), forked into its samples (`n` > 1) and its prefix
groups, and queued in the scheduler; or finished at once with an error that only this request
gets (its output comes from the next step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from actors.config import SamplingParams
from actors.detokenizer import Detokenizer
from actors.guided import GuidedDecoder
from actors.outputs import RequestOutput
from actors.prefix_sharing import call_groups, plan_groups, planned_order
from actors.request import Request, RequestStatus, SharedPrefixState
from actors.rope import RopePolicy
from actors.samples import SampleBook, fork_samples, sample_id
from actors.tokenization import encode_text
from actors.virtual_schedulers import VirtualSchedulers

if TYPE_CHECKING:
    from packing.prefix import PrefixGroup

logger = logging.getLogger("actors.engine")  # the engine's lines, under its name as before


class PromptQueue:
    """`LLMEngine`'s prompts in, its requests queued (actors/engine.py sets these attributes)."""

    tokenizer: Any
    rope: RopePolicy | None
    max_model_len: int
    vocab_size: int
    default_params: SamplingParams
    detokenizer: Detokenizer
    guided: GuidedDecoder
    scheduler: VirtualSchedulers
    _requests: dict[str, Request]
    _samples: SampleBook
    _pending: list[RequestOutput]
    _next_id: int

    def _queue(
        self,
        prompts: Sequence[str | Sequence[int]],
        per_prompt: list[SamplingParams],
        prefix_groups: Sequence[PrefixGroup] | None,  # None: planned here over the prompts
        request_id: str | None,  # the one prompt's id (add_request), else new ids
    ) -> list[str]:
        token_ids = [self._try_tokenize(p) for p in prompts]  # None: _add reports the error
        if prefix_groups is None:
            prefix_groups = call_groups(token_ids)
        fork = fork_samples(
            token_ids, per_prompt, prefix_groups, lambda ids: self._check_prompt(ids) is None
        )
        groups = plan_groups(
            [token_ids[i] or [] for i in fork.origin],
            fork.groups,
            runnable=lambda ids: self._check_prompt(ids) is None,
            new_id=lambda: self._new_id("prefix"),
            cache_salt=self.rope.cache_salt if self.rope is not None else None,
        )
        ids = [request_id or self._new_id("req") for _ in prompts]
        for rid, prompt_params in zip(ids, per_prompt, strict=True):
            self._samples.add(rid, prompt_params)
        queued: set[int] = set()
        for index in planned_order(len(fork.origin), fork.groups):
            chain = []  # the prompt's groups not queued yet, innermost first
            group = groups.get(index)
            while group is not None and id(group) not in queued:
                chain.append(group)
                group = group.parent
            for group in reversed(chain):  # a shared prefix runs before its members
                self.scheduler.add(group.prefix)
                queued.add(id(group))
            origin, sample = fork.origin[index], fork.sample_index[index]
            tokens = token_ids[origin]
            prompt = prompts[origin] if tokens is None else tokens
            rid = sample_id(ids[origin], sample, per_prompt[origin].num_samples)
            parent = None if rid == ids[origin] else (ids[origin], sample)
            self._add(prompt, fork.params[index], rid, group, parent)
        return ids

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return encode_text(self.tokenizer, prompt)  # as tokenizer(prompt) does
        return [int(t) for t in prompt]

    def _try_tokenize(self, prompt: str | Sequence[int]) -> list[int] | None:
        try:
            return self._tokenize(prompt)
        except Exception:  # noqa: BLE001 (_add tokenizes it again and reports the error)
            return None

    def _add(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None,
        request_id: str | None,
        group: SharedPrefixState | None,
        sample: tuple[str, int] | None = None,  # (the caller's request id, sample index)
    ) -> Request:
        """Queue a request, or finish it at once with an error: a prompt that cannot run, or
        anything that raises while the request is built (only this request fails)."""
        parent_id, sample_index = sample or (None, 0)
        if request_id is None:
            request_id = self._new_id("req")
        elif request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids: list[int] = []
        try:
            ids = self._tokenize(prompt)
            req = Request(request_id, ids, params or self.default_params, group=group)
            req.parent_id, req.sample_index = parent_id, sample_index
            if self.rope is not None:
                req.cache_salt = self.rope.cache_salt(req.rope_len)
            self.detokenizer.start(req)
        except Exception as exc:  # noqa: BLE001 (this request's fault; the engine goes on)
            logger.exception("request %s could not be admitted", request_id)
            req = Request(request_id, ids, SamplingParams(), group=group)
            req.parent_id, req.sample_index = parent_id, sample_index
            return self._reject(req, f"admitting the request failed: {_describe(exc)}")
        error = self._check_prompt(req.prompt_token_ids)
        if error is not None:
            assert group is None, "members with invalid prompts are left out of groups"
            return self._reject(req, error)
        bad = [t for t, _ in req.params.logit_bias if t >= self.vocab_size]
        if bad:
            return self._reject(
                req,
                f"logit_bias token ids outside the vocabulary (size {self.vocab_size}): {bad[:5]}",
            )
        if req.params.guided_decoding is not None:
            try:  # compiled here, outside the step (once per distinct grammar)
                self.guided.start(req)
            except Exception as exc:  # noqa: BLE001 (this request's grammar; the engine goes on)
                return self._reject(req, f"guided decoding: {_describe(exc)}")
        self._requests[request_id] = req
        self.scheduler.add(req)
        return req

    def _reject(self, req: Request, error: str) -> Request:
        """Finish a request that never ran with `error`; its output comes from the next step.
        A group member is counted by its group: it is queued and ended in its scheduler, so
        the group's prefix is released when its last member ends."""
        req.error = error
        if req.group is not None:
            self.scheduler.add(req)
            self.scheduler.finish([req], "error")
        req.status = RequestStatus.FINISHED
        req.finish_reason = "error"
        self._finish_time(req)
        self._pending.append(req.to_output())
        return req

    def _new_id(self, kind: str) -> str:
        self._next_id += 1
        return f"{kind}-{self._next_id - 1}"

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

    @staticmethod
    def _finish_time(req: Request) -> None:
        if req.finished_time is None:
            req.finished_time = time.monotonic()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
