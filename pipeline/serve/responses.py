"""Response bodies and server-sent events built from engine outputs."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from actors.outputs import RequestOutput, TokenLogprob
from pipeline.serve.errors import internal_error
from pipeline.serve.logprobs import LogprobShaper
from pipeline.serve.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    ResponseMessage,
    Usage,
)

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
Kind = Literal["completion", "chat"]
Reason = Literal["stop", "length"]


def sse(body: dict[str, object]) -> str:
    """One server-sent event carrying a JSON body."""
    return f"data: {json.dumps(body)}\n\n"


@dataclass(frozen=True)
class ResponseHeader:
    """What every body or chunk of one response repeats."""

    kind: Kind
    request_id: str
    created: int
    model: str
    logprobs: LogprobShaper | None = None  # set when the request asked for logprobs

    def full(self, outputs: RequestOutput | Sequence[RequestOutput]) -> BaseModel:
        """The non-streamed body for a request's finished outputs, one choice per sample
        (`index` = its sample_index)."""
        if isinstance(outputs, RequestOutput):
            outputs = [outputs]
        shaper = self.logprobs
        if self.kind == "completion":
            choices = [
                CompletionChoice(
                    index=out.sample_index,
                    text=out.text,
                    logprobs=None if shaper is None else shaper.completion(out.logprobs or ()),
                    finish_reason=finish_reason(out, self.request_id),
                )
                for out in outputs
            ]
            return CompletionResponse(
                id=self.request_id,
                created=self.created,
                model=self.model,
                choices=choices,
                usage=usage(outputs),
            )
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[
                ChatChoice(
                    index=out.sample_index,
                    message=ResponseMessage(content=out.text),
                    logprobs=None if shaper is None else shaper.chat(out.logprobs or ()),
                    finish_reason=finish_reason(out, self.request_id),
                )
                for out in outputs
            ],
            usage=usage(outputs),
        )

    def role_event(self, index: int = 0) -> str:
        """The first chunk of a chat stream's choice `index`: the assistant's role."""
        choice = ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
        return self._chat_chunk([choice], None)

    def text_event(
        self,
        text: str,
        reason: Reason | None,
        entries: Sequence[TokenLogprob] = (),
        offset: int = 0,
        index: int = 0,
    ) -> str:
        """A chunk of choice `index` with new text (and, in the last one, the finish reason);
        with logprobs, those of the tokens not sent before (`offset`: the text_offset of the
        first of them)."""
        shaper = self.logprobs if entries else None
        if self.kind == "chat":
            delta = DeltaMessage(content=text or None)
            logprobs = None if shaper is None else shaper.chat(entries)
            chunk = ChatStreamChoice(
                index=index, delta=delta, logprobs=logprobs, finish_reason=reason
            )
            return self._chat_chunk([chunk])
        completion = None if shaper is None else shaper.completion(entries, offset)
        choice = CompletionChoice(index=index, text=text, logprobs=completion, finish_reason=reason)
        return self._completion_chunk([choice], None)

    def usage_event(self, counts: Usage) -> str:
        """The usage chunk (stream_options.include_usage): no choices, only counts."""
        if self.kind == "chat":
            return self._chat_chunk([], counts)
        return self._completion_chunk([], counts)

    def _completion_chunk(self, choices: list[CompletionChoice], counts: Usage | None) -> str:
        body = CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=counts,
        )
        return f"data: {body.model_dump_json()}\n\n"

    def _chat_chunk(self, choices: list[ChatStreamChoice], counts: Usage | None = None) -> str:
        body = ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=counts,
        )
        return f"data: {body.model_dump_json()}\n\n"


def finish_reason(output: RequestOutput, request_id: str) -> Reason:
    """OpenAI's finish reason; an engine error or abort becomes a generic 500 APIError naming
    `request_id` (the cause is logged, never sent)."""
    if output.finish_reason in ("stop", "length"):
        return output.finish_reason
    logger.error(
        "request %s (engine %s) ended with %r: %s",
        request_id, output.request_id, output.finish_reason, output.error,
    )  # fmt: skip
    raise internal_error(request_id)


def usage(outputs: RequestOutput | Sequence[RequestOutput]) -> Usage:
    """Token counts of a request's outputs: the prompt once, every sample's completion
    tokens; cached tokens are the first sample's (with n > 1, what it took from the prompt's
    shared prefill, prefix-cache hits included)."""
    if isinstance(outputs, RequestOutput):
        outputs = [outputs]
    first = outputs[0]
    completion = sum(len(out.token_ids) for out in outputs)
    return Usage(
        prompt_tokens=first.num_prompt_tokens,
        completion_tokens=completion,
        total_tokens=first.num_prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=first.num_cached_tokens),
    )
