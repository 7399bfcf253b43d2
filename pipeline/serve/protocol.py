"""OpenAI-compatible request and response bodies (the HTTP edge; pydantic only here).

Requests reject unknown fields and wrong types (strict mode), so a typo is a 400 that names the
field rather than a silently ignored option. vLLM extensions accepted: `top_k`, `ignore_eos`,
`repetition_penalty` and `min_p`, and the structured-output fields (`guided_json`...).
Numbers are bounded here or in `actors.config.SamplingParams`
(the one place that decides what the engine can hold; its ValueError is a 400 too): NaN and
infinities are refused, seeds fit 64 bits and top_k 32 bits.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from actors.config import MAX_INT32, MAX_LOGPROBS, MAX_SAMPLES, MAX_SEED, MIN_SEED
from pipeline.serve.guided import GuidedFields

FinishReason = Literal["stop", "length"]
MAX_STOP_STRINGS = 4  # OpenAI's limit
# The pydantic error type of a content part this server cannot read (errors.py: a 400 with
# code unsupported_value), and what OpenAI's and vLLM's non-text part types carry.
UNSUPPORTED_PART = "unsupported_content_part"
_PART_KINDS = {
    "image_url": "images are",
    "input_image": "images are",
    "image_embeds": "images are",
    "input_audio": "audio is",
    "audio_url": "audio is",
    "video_url": "video is",
    "file": "files are",
}


def json_value(body: bytes) -> Any:
    """The JSON value of a request body, parsed as the request models parse it (pydantic's
    parser, with its nesting limit of 200); None when it is not JSON, also when it nests deeper
    (Python's `json.loads` raises RecursionError there, a 500, where the models' 400 belongs)."""
    try:
        return pydantic_core.from_json(body)
    except ValueError:
        return None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    """Options for streamed responses."""

    include_usage: bool = Field(
        default=False, description="Send a last chunk with the token usage before `data: [DONE]`."
    )


class _SamplingFields(_Request, GuidedFields):
    """Sampling fields shared by completions and chat completions (structured output:
    pipeline/serve/guided.py)."""

    model: str = Field(description="The served model's name (see GET /v1/models).")
    temperature: float | None = Field(
        default=None, ge=0.0, le=2.0, description="Sampling temperature; 0 is greedy. Default 1."
    )
    top_p: float | None = Field(
        default=None, gt=0.0, le=1.0, description="Nucleus sampling: keep this probability mass."
    )
    top_k: int | None = Field(
        default=None,
        ge=-1,
        le=MAX_INT32,
        description="vLLM extension: keep the k most likely tokens (0 or -1: all).",
    )
    stop: str | list[str] | None = Field(
        default=None, description="Up to 4 strings that end generation; they are cut from the text."
    )
    seed: int | None = Field(
        default=None,
        ge=MIN_SEED,
        le=MAX_SEED,
        description="Seed for sampling; same seed, same tokens (-2**63 to 2**64 - 1).",
    )
    n: int = Field(
        default=1,
        ge=1,
        le=MAX_SAMPLES,
        description="Number of choices (samples of the prompt, which is prefilled once); "
        "with a seed, choice i draws from seed + i.",
    )
    stream: bool = Field(default=False, description="Stream tokens as server-sent events.")
    stream_options: StreamOptions | None = Field(
        default=None, description="Streaming options (only with stream=true)."
    )
    user: str | None = Field(default=None, description="An end-user id; accepted and ignored.")
    presence_penalty: float | None = Field(
        default=None,
        description="Subtracted from the logit of every token already generated (-2 to 2). "
        "Default 0.",
    )
    frequency_penalty: float | None = Field(
        default=None,
        description="Times a token's count in the output, subtracted from its logit (-2 to 2). "
        "Default 0.",
    )
    repetition_penalty: float | None = Field(
        default=None,
        description="vLLM extension: divides positive (multiplies negative) logits of tokens "
        "in the prompt or the output (> 0; 1 is off). Default 1.",
    )
    min_p: float | None = Field(
        default=None,
        description="vLLM extension: drop tokens less likely than min_p times the best one "
        "(0 to 1, after temperature). Default 0.",
    )
    logit_bias: dict[str, float] | None = Field(
        default=None,
        description="Token id (as text) -> bias in [-100, 100] added to its logit.",
    )
    ignore_eos: bool = Field(
        default=False, description="vLLM extension: keep generating past the end-of-sequence token."
    )

    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings as a tuple."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) of the first OpenAI option set to something this server cannot do.

        Such fields are accepted at their neutral values (clients often send `"logprobs":
        null` or `"echo": false`) and refused otherwise, never silently ignored."""
        return None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="The prompt: text or token ids (a list holding one prompt is accepted)."
    )
    max_tokens: int | None = Field(
        default=None, ge=1, description="Tokens to generate at most. Default 16."
    )
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Return each generated token's logprob and the k most likely tokens' "
        "(0 to 20 as vLLM; OpenAI allows 5).",
    )
    echo: bool = Field(default=False, description="Not supported: only false is accepted.")
    best_of: int | None = Field(
        default=None,
        ge=1,
        le=MAX_SAMPLES,
        description="Generate best_of candidates and return the n with the highest "
        "cumulative logprob (at least n; not with stream).",
    )
    add_special_tokens: bool = Field(
        default=True,
        description="Add the tokenizer's special tokens (e.g. BOS) to a text prompt, as "
        "tokenizer(prompt) does (vLLM's extra field).",
    )

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) of the first option set to something this server cannot do."""
        if self.echo:
            return "echo", "echo is not supported by this server; omit it or send false"
        if self.best_of not in (None, self.n) and self.stream:
            return "best_of", "best_of > n cannot be streamed (as OpenAI and vLLM)"
        return super().unsupported()


class TextPart(_Request):
    """A text part of a chat message's content."""

    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str = Field(description="The text.")


class ChatMessage(_Request):
    """One chat message."""

    role: Literal["system", "developer", "user", "assistant"] = Field(
        description="Who wrote the message."
    )
    content: str | list[TextPart] = Field(description="The message text, or its text parts.")
    name: str | None = Field(default=None, description="An optional participant name; ignored.")

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """A part of another type (an image, audio...) is refused by name, before the union's
        own message ("Input should be a valid string") says nothing of why."""
        if not isinstance(content, list):
            return content
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                what = _PART_KINDS.get(kind, "content parts of type '{kind}' are")
                raise PydanticCustomError(
                    UNSUPPORTED_PART,
                    what + " not supported: this server's model reads text only; send the "
                    "content as a string or as parts of type 'text' (got a part of type "
                    "'{kind}')",
                    {"kind": kind[:40]},
                )
        return content

    def text(self) -> str:
        """The content as one string."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(
        min_length=1, description="The conversation so far; the model's chat template is applied."
    )
    max_tokens: int | None = Field(
        default=None, ge=1, description="Tokens to generate at most (deprecated name by OpenAI)."
    )
    max_completion_tokens: int | None = Field(
        default=None, ge=1, description="Tokens to generate at most. Default: the server's limit."
    )
    logprobs: bool | None = Field(
        default=None, description="Return each generated token's logprob (choices[].logprobs)."
    )
    top_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="With logprobs: true, also the k most likely tokens at each position.",
    )
    chat_template: str | None = Field(
        default=None,
        min_length=1,
        description="vLLM extension: a chat template (Jinja text) used for this request "
        "instead of the server's (only on a server started with --trust-request-chat-template).",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description="vLLM extension: variables for the chat template, e.g. "
        '{"enable_thinking": false} for Qwen3.',
    )


class PromptTokensDetails(BaseModel):
    """Where the prompt tokens came from."""

    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")


class Usage(BaseModel):
    """Token counts of one request."""

    prompt_tokens: int = Field(description="Tokens in the prompt.")
    completion_tokens: int = Field(description="Tokens generated.")
    total_tokens: int = Field(description="prompt_tokens + completion_tokens.")
    prompt_tokens_details: PromptTokensDetails = Field(description="Prefix-cache hits.")


class CompletionLogprobs(BaseModel):
    """Logprobs of a completion's tokens (OpenAI's legacy shape)."""

    tokens: list[str] = Field(description="Each generated token, decoded alone.")
    token_logprobs: list[float] = Field(description="Each token's logprob.")
    top_logprobs: list[dict[str, float]] = Field(
        description="Per token: the k most likely tokens and the sampled one -> logprob."
    )
    text_offset: list[int] = Field(description="Each token's offset in the concatenated tokens.")


class TopLogprob(BaseModel):
    """One likely token at a position of a chat completion."""

    token: str = Field(description="The token, decoded alone.")
    logprob: float = Field(description="Its logprob (-9999.0 when -inf).")
    bytes: list[int] | None = Field(description="The token's UTF-8 bytes.")


class TokenLogprobEntry(TopLogprob):
    """One generated token of a chat completion, with the most likely alternatives."""

    top_logprobs: list[TopLogprob] = Field(description="The top_logprobs most likely tokens.")


class ChatLogprobs(BaseModel):
    """Logprobs of a chat completion's tokens."""

    content: list[TokenLogprobEntry] | None = Field(description="One entry per token.")


class CompletionChoice(BaseModel):
    """One completion (or, in a stream, its newest text)."""

    index: int = Field(description="The choice's position; always 0 here.")
    text: str = Field(description="The generated text (in a stream: the new text only).")
    logprobs: CompletionLogprobs | None = Field(
        default=None, description="With `logprobs` (in a stream: of the new tokens)."
    )
    finish_reason: FinishReason | None = Field(
        description="stop (end of sequence or a stop string) or length; null while streaming."
    )


class CompletionResponse(BaseModel):
    """The body of a completion, or one streamed chunk of it."""

    id: str = Field(description="The request id (cmpl-...).")
    object: Literal["text_completion"] = Field(default="text_completion", description="The type.")
    created: int = Field(description="Unix time the request arrived.")
    model: str = Field(description="The served model's name.")
    choices: list[CompletionChoice] = Field(description="The completions.")
    usage: Usage | None = Field(default=None, description="Token counts (null in stream chunks).")


class ResponseMessage(BaseModel):
    """The assistant's message in a chat completion."""

    role: Literal["assistant"] = Field(default="assistant", description="Always assistant.")
    content: str = Field(description="The generated text.")


class ChatChoice(BaseModel):
    """One chat completion choice."""

    index: int = Field(description="The choice's position; always 0 here.")
    message: ResponseMessage = Field(description="The generated message.")
    logprobs: ChatLogprobs | None = Field(default=None, description="With `logprobs: true`.")
    finish_reason: FinishReason = Field(description="stop or length.")


class ChatCompletionResponse(BaseModel):
    """The body of a chat completion."""

    id: str = Field(description="The request id (chatcmpl-...).")
    object: Literal["chat.completion"] = Field(default="chat.completion", description="The type.")
    created: int = Field(description="Unix time the request arrived.")
    model: str = Field(description="The served model's name.")
    choices: list[ChatChoice] = Field(description="The choices.")
    usage: Usage = Field(description="Token counts.")


class DeltaMessage(BaseModel):
    """What a stream chunk adds to the assistant's message."""

    role: Literal["assistant"] | None = Field(
        default=None, description="Set in the first chunk only."
    )
    content: str | None = Field(default=None, description="New text.")


class ChatStreamChoice(BaseModel):
    """One choice of a chat stream chunk."""

    index: int = Field(description="The choice's position; always 0 here.")
    delta: DeltaMessage = Field(description="The new part of the message.")
    logprobs: ChatLogprobs | None = Field(
        default=None, description="With `logprobs: true`: of the new tokens."
    )
    finish_reason: FinishReason | None = Field(default=None, description="Set in the last chunk.")


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str = Field(description="The request id (chatcmpl-...), the same in every chunk.")
    object: Literal["chat.completion.chunk"] = Field(
        default="chat.completion.chunk", description="The type."
    )
    created: int = Field(description="Unix time the request arrived.")
    model: str = Field(description="The served model's name.")
    choices: list[ChatStreamChoice] = Field(description="Empty in the usage chunk.")
    usage: Usage | None = Field(default=None, description="Token counts, in the usage chunk only.")


class ModelCard(BaseModel):
    """One served model."""

    id: str = Field(description="The name to pass as `model`.")
    object: Literal["model"] = Field(default="model", description="The type.")
    created: int = Field(description="Unix time the server started.")
    owned_by: str = Field(default="raypack", description="Who serves it.")
    max_model_len: int = Field(description="Context length: prompt plus generated tokens.")


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = Field(default="list", description="The type.")
    data: list[ModelCard] = Field(description="The served models.")


class ErrorDetail(BaseModel):
    """OpenAI's error object."""

    message: str = Field(description="What went wrong, in words.")
    type: str = Field(description="invalid_request_error, authentication_error, ...")
    param: str | None = Field(default=None, description="The request field at fault, when one is.")
    code: str | None = Field(
        default=None, description="A machine-readable code, when there is one."
    )


class ErrorResponse(BaseModel):
    """The body of every error response."""

    error: ErrorDetail = Field(description="The error.")


class HealthResponse(BaseModel):
    """GET /health."""

    status: Literal["ok"] = Field(
        default="ok", description="The replica and its step loop are alive."
    )
    waiting: int = Field(description="Requests in the staging queue.")
    running: int = Field(description="Requests admitted to the engine and not yet finished.")
    policy: str = Field(description="The admission policy: immediate, fixed or aimd.")
    threshold: int = Field(description="The admission controller's current N_t.")
    aborted: int = Field(description="Requests dropped so far because their client went away.")
