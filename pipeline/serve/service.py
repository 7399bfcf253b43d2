"""The OpenAI API over the engine loop: validate, tokenize, check limits, submit, shape answers.

Independent of FastAPI and Ray: it takes raw bodies and gives pydantic bodies or SSE lines.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from actors.config import SamplingParams, logit_bias_pairs
from actors.detokenizer import StreamCursor
from actors.outputs import RequestOutput
from actors.tokenization import ChatTemplateError, encode_chat, encode_text
from pipeline.serve.config import ServeConfig
from pipeline.serve.errors import (
    APIError,
    bad_request,
    busy,
    from_validation_error,
    internal_error,
)
from pipeline.serve.guided import GuidedFieldError
from pipeline.serve.logprobs import LogprobShaper
from pipeline.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from pipeline.serve.responses import DONE, ResponseHeader, finish_reason, sse, usage
from pipeline.serve.staging import (
    EngineFailedError,
    EngineLoop,
    QueueFullError,
    QueueTimeoutError,
    RequestStream,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready for the staging queue."""

    header: ResponseHeader
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool


class OpenAIService:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI answers."""

    def __init__(
        self,
        config: ServeConfig,
        loop: EngineLoop,
        tokenizer: Any,
        max_model_len: int,
        vocab_size: int,
        sampling_defaults: dict[str, Any] | None = None,
    ) -> None:
        """`sampling_defaults`: the model's own (the engine's `sampling_defaults`), for the
        fields a request leaves unset, as vLLM's server does."""
        self.config = config
        self.sampling_defaults = dict(sampling_defaults or {})
        self.loop = loop
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_prompt_tokens = min(config.max_prompt_tokens or max_model_len, max_model_len - 1)
        self.started = int(time.time())

    def _or_default(self, value: Any, name: str, fallback: Any) -> Any:
        """A request's field, else the model's generation config's, else OpenAI's default."""
        return value if value is not None else self.sampling_defaults.get(name, fallback)

    def models(self) -> ModelList:
        """GET /v1/models."""
        card = ModelCard(
            id=self.config.model_name, created=self.started, max_model_len=self.max_model_len
        )
        return ModelList(data=[card])

    def prepare_completion(self, body: bytes) -> Prepared:
        """Validate a /v1/completions body; APIError (400/404) when it is not acceptable."""
        request = _parse(CompletionRequest, body)
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise bad_request(
                    f"only one prompt per request is supported, got {len(prompt)}", "prompt"
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            # As the engine and Hugging Face: tokenizer(prompt), special tokens included.
            ids = encode_text(self.tokenizer, prompt, add_special_tokens=request.add_special_tokens)
        else:
            ids = [int(t) for t in prompt]
            vocab = self.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise bad_request(
                    f"prompt token ids must be in [0, {vocab}), got {bad[0]}", "prompt"
                )
        max_tokens = request.max_tokens or self.config.default_completion_tokens
        return self._prepared("completion", "cmpl", request, ids, max_tokens, "prompt")

    def prepare_chat(self, body: bytes) -> Prepared:
        """Validate a /v1/chat/completions body and apply the chat template."""
        request = _parse(ChatCompletionRequest, body)
        if request.top_logprobs is not None and not request.logprobs:  # as OpenAI and vLLM
            raise bad_request("top_logprobs is only allowed with logprobs: true", "top_logprobs")
        if request.chat_template is not None and not self.config.trust_request_chat_template:
            raise bad_request(
                "chat_template in a request needs a server started with "
                "--trust-request-chat-template (it runs the client's template in the server)",
                "chat_template",
            )
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        try:  # as apply_chat_template(..., tokenize=True): no BOS on top of the template's
            ids = encode_chat(
                self.tokenizer,
                messages,
                allow_special_tokens=self.config.allow_special_tokens_in_messages,
                chat_template=request.chat_template or self.config.chat_template,
                template_kwargs=request.chat_template_kwargs,
            )
        except ChatTemplateError as exc:  # a template may reject a conversation
            raise bad_request(
                f"the chat template rejected the messages: {exc}", "messages"
            ) from exc
        asked = request.max_completion_tokens or request.max_tokens
        max_tokens = asked or max(
            1, min(self.config.max_tokens_limit, self.max_model_len - len(ids))
        )
        return self._prepared("chat", "chatcmpl", request, ids, max_tokens, "messages")

    def submit(self, prepared: Prepared, arrival: float | None = None) -> RequestStream:
        """Queue the request; a 429 APIError with Retry-After when the staging queue is full.
        `arrival`: when it reached the replica (pipeline/serve/gate.py), the start of its
        max_queue_wait_s (default: now)."""
        try:
            return self.loop.submit(prepared.prompt_token_ids, prepared.params, arrival)
        except QueueFullError as exc:
            raise self.busy(exc) from exc

    def busy(self, exc: Exception) -> APIError:
        """429 with Retry-After: the staging queue is full or the request waited too long."""
        return busy(str(exc), self.config.retry_after_s)

    async def respond(self, prepared: Prepared, stream: RequestStream) -> BaseModel:
        """Wait for the whole answer (non-streaming): a choice per sample."""
        finals: dict[int, RequestOutput] = {}
        try:
            async for output in stream:
                finals[output.sample_index] = output
        except QueueTimeoutError as exc:
            raise self.busy(exc) from exc
        except EngineFailedError as exc:
            logger.error("request %s failed in the engine: %s", prepared.header.request_id, exc)
            raise internal_error(prepared.header.request_id) from exc
        finally:
            if not _finished(finals, prepared.params.n):
                self.loop.abort(stream.request_id)
        assert _finished(finals, prepared.params.n)
        return prepared.header.full([finals[i] for i in range(prepared.params.n)])

    async def events(self, prepared: Prepared, stream: RequestStream) -> AsyncIterator[str]:
        """Server-sent events, one per new piece of text of one choice (each chunk names its
        choice's `index`: a sample of n), ending with `data: [DONE]`."""
        header = prepared.header
        # The engine cuts a stop string from the text once it is complete: each choice's
        # cursor holds back what could still be one's start, so the pieces sent are the
        # unstreamed text.
        n = prepared.params.n
        cursors = [StreamCursor.for_stops(prepared.params.stop) for _ in range(n)]
        sent_logprobs = [0] * n  # logprobs entries already sent, and the text_offset after them
        offset = [0] * n
        finals: dict[int, RequestOutput] = {}
        try:
            if header.kind == "chat":
                for index in range(n):
                    yield header.role_event(index)
            async for output in stream:
                i = output.sample_index
                finals[i] = output
                reason = finish_reason(output, header.request_id) if output.finished else None
                delta = cursors[i].release(output.text, output.finished)
                if delta or reason is not None:
                    # The logprobs of the tokens since the last chunk (held-back text or not).
                    entries = (output.logprobs or ())[sent_logprobs[i] :]
                    yield header.text_event(delta, reason, entries, offset[i], i)
                    sent_logprobs[i] += len(entries)
                    if entries and header.logprobs is not None and header.kind == "completion":
                        offset[i] += sum(len(header.logprobs.token(e.token_id)) for e in entries)
            if finals and prepared.include_usage:
                yield header.usage_event(usage([finals[i] for i in sorted(finals)]))
        except QueueTimeoutError as exc:
            yield sse(self.busy(exc).body())
        except EngineFailedError as exc:
            logger.error("request %s failed in the engine: %s", header.request_id, exc)
            yield sse(internal_error(header.request_id).body())
        except APIError as exc:
            yield sse(exc.body())
        finally:
            if not _finished(finals, n):
                self.loop.abort(stream.request_id)
        yield DONE

    def _prepared(
        self,
        kind: Literal["completion", "chat"],
        prefix: str,
        request: CompletionRequest | ChatCompletionRequest,
        ids: list[int],
        max_tokens: int,
        prompt_field: str,
    ) -> Prepared:
        if request.model != self.config.model_name:
            raise APIError(
                404,
                f"the model '{request.model}' does not exist; this server serves "
                f"'{self.config.model_name}'",
                param="model",
                code="model_not_found",
            )
        if not ids:
            raise bad_request(f"the prompt ({prompt_field}) is empty", prompt_field)
        if len(ids) > self.max_prompt_tokens:
            raise bad_request(
                f"the prompt ({prompt_field}) has {len(ids)} tokens; this server accepts at most "
                f"{self.max_prompt_tokens} (the model's context is {self.max_model_len})",
                prompt_field,
                "context_length_exceeded",
            )
        if max_tokens > self.config.max_tokens_limit:
            raise bad_request(
                f"max_tokens is {max_tokens}; this server allows at most "
                f"{self.config.max_tokens_limit}",
                "max_tokens",
            )
        if len(ids) + max_tokens > self.max_model_len:
            raise bad_request(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{len(ids) + max_tokens} were requested ({len(ids)} in the prompt, "
                f"{max_tokens} for the completion): lower max_tokens or shorten the prompt",
                "max_tokens",
                "context_length_exceeded",
            )
        unsupported = request.unsupported()
        if unsupported is not None:
            raise bad_request(unsupported[1], unsupported[0], "unsupported_value")
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        try:
            guided, _ = request.guided_decoding()
        except GuidedFieldError as exc:
            raise bad_request(str(exc), exc.param) from exc
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=self._or_default(request.temperature, "temperature", 1.0),
                top_p=self._or_default(request.top_p, "top_p", 1.0),
                top_k=self._or_default(request.top_k, "top_k", 0),
                seed=request.seed,
                stop=request.stop_strings(),
                ignore_eos=request.ignore_eos,
                logprobs=_logprobs(request),
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                repetition_penalty=self._or_default(
                    request.repetition_penalty, "repetition_penalty", 1.0
                ),
                min_p=self._or_default(request.min_p, "min_p", 0.0),
                logit_bias=logit_bias_pairs(request.logit_bias or {}),
                n=request.n,
                best_of=getattr(request, "best_of", None),
                guided_decoding=guided,
            )
        except ValueError as exc:  # SamplingParams bounds every value; its message names it
            raise bad_request(str(exc), _sampling_param(str(exc), request)) from exc
        outside = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if outside:
            raise bad_request(
                f"logit_bias token ids must be in [0, {self.vocab_size}), got {outside[0]}",
                "logit_bias",
            )
        if len(params.stop) > 4:
            raise bad_request(f"at most 4 stop strings, got {len(params.stop)}", "stop")
        header = ResponseHeader(
            kind,
            f"{prefix}-{uuid.uuid4().hex}",
            int(time.time()),
            self.config.model_name,
            None if params.logprobs is None else LogprobShaper(self.tokenizer),
        )
        return Prepared(
            header=header,
            prompt_token_ids=ids,
            params=params,
            stream=request.stream,
            include_usage=bool(request.stream_options and request.stream_options.include_usage),
        )


def _finished(finals: dict[int, RequestOutput], n: int) -> bool:
    return len(finals) == n and all(out.finished for out in finals.values())


def _logprobs(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many top tokens the engine returns per generated token; None: no logprobs."""
    if isinstance(request, CompletionRequest):
        return request.logprobs
    return (request.top_logprobs or 0) if request.logprobs else None


def _sampling_param(message: str, request: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The request field a SamplingParams error is about (its message starts with the name)."""
    name = message.split(" ", 1)[0]
    if name == "max_tokens" and getattr(request, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    return name if name in type(request).model_fields else None


def _parse(model: type[CompletionRequest] | type[ChatCompletionRequest], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc
