"""POST /tokenize and POST /detokenize with vLLM's request and response shapes, and
GET /v1/models/{id}.

    /tokenize    {"model", "prompt"} or {"model", "messages"} -> {"count", "max_model_len",
                 "tokens"} (+ "token_strs" when `return_token_strs`)
    /detokenize  {"model", "tokens"} -> {"prompt"}

`model` is optional as in vLLM; a name this server does not serve is a 404. Prompts are
tokenized as /v1/completions and /v1/chat/completions tokenize them, so `count` is the
`usage.prompt_tokens` a completion of the same prompt reports. As in vLLM,
`add_special_tokens` defaults to true for a prompt (the tokenizer's BOS..., as
`tokenizer(prompt)` and completions add them) and to false for messages (the chat template
writes its own; true adds the tokenizer's on top). actors/tokenization.py does the encoding.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, ValidationError

from actors.tokenization import ChatTemplateError, encode_chat, encode_text
from pipeline.serve.errors import APIError, bad_request, from_validation_error
from pipeline.serve.protocol import ChatMessage, ModelCard, _Request, json_value


class TokenizeCompletionRequest(_Request):
    """POST /tokenize with a text prompt."""

    model: str | None = Field(default=None, description="The served model's name (optional).")
    prompt: str = Field(description="The text to tokenize.")
    add_special_tokens: bool = Field(
        default=True, description="Add the tokenizer's special tokens (e.g. BOS)."
    )
    return_token_strs: bool = Field(default=False, description="Also return each token's text.")


class TokenizeChatRequest(_Request):
    """POST /tokenize with a conversation (the model's chat template is applied)."""

    model: str | None = Field(default=None, description="The served model's name (optional).")
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation.")
    add_generation_prompt: bool = Field(
        default=True, description="End with the template's assistant header, as chat does."
    )
    add_special_tokens: bool = Field(
        default=False, description="Add the tokenizer's special tokens on top of the template."
    )
    return_token_strs: bool = Field(default=False, description="Also return each token's text.")


class TokenizeResponse(BaseModel):
    """The answer of POST /tokenize."""

    count: int = Field(description="How many tokens.")
    max_model_len: int = Field(description="The model's context length.")
    tokens: list[int] = Field(description="The token ids.")
    token_strs: list[str] | None = Field(
        default=None, description="Each token as the tokenizer spells it, when asked."
    )


class DetokenizeRequest(_Request):
    """POST /detokenize."""

    model: str | None = Field(default=None, description="The served model's name (optional).")
    tokens: list[int] = Field(description="Token ids to turn into text.")


class DetokenizeResponse(BaseModel):
    """The answer of POST /detokenize."""

    prompt: str = Field(description="The text of the tokens (special tokens included).")


def model_not_found(name: str, served: str) -> APIError:
    """The 404 for a model name this server does not serve (as completions give it)."""
    return APIError(
        404,
        f"the model '{name}' does not exist; this server serves '{served}'",
        param="model",
        code="model_not_found",
    )


def model_card(requested: str, card: ModelCard) -> ModelCard:
    """GET /v1/models/{id}: the card, or a 404 when `requested` is not the served model."""
    if requested != card.id:
        raise model_not_found(requested, card.id)
    return card


def tokenize(
    body: bytes,
    tokenizer: Any,
    served: str,
    max_model_len: int,
    *,
    allow_special_tokens_in_messages: bool = False,
) -> TokenizeResponse:
    """POST /tokenize: a 400 naming the field for a bad body, 404 for another model. Messages
    are tokenized as chat completions tokenize them (ServeConfig's
    `allow_special_tokens_in_messages`)."""
    request: TokenizeCompletionRequest | TokenizeChatRequest
    chat = _has_field(body, "messages")
    request = _parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
    _check_model(request.model, served)
    if isinstance(request, TokenizeChatRequest):
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        try:
            ids = encode_chat(
                tokenizer,
                messages,
                add_generation_prompt=request.add_generation_prompt,
                add_special_tokens=request.add_special_tokens,
                allow_special_tokens=allow_special_tokens_in_messages,
            )
        except ChatTemplateError as exc:  # a template may reject a conversation
            raise bad_request(
                f"the chat template rejected the messages: {exc}", "messages"
            ) from exc
    else:
        ids = encode_text(tokenizer, request.prompt, add_special_tokens=request.add_special_tokens)
    strs = list(tokenizer.convert_ids_to_tokens(ids)) if request.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs
    )


def detokenize(body: bytes, tokenizer: Any, served: str, vocab_size: int) -> DetokenizeResponse:
    """POST /detokenize: ids outside the vocabulary are a 400 naming `tokens`."""
    request = _parse(DetokenizeRequest, body)
    _check_model(request.model, served)
    bad = [t for t in request.tokens if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token ids must be in [0, {vocab_size}), got {bad[0]}", "tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))


def _check_model(name: str | None, served: str) -> None:
    if name is not None and name != served:
        raise model_not_found(name, served)


def _has_field(body: bytes, name: str) -> bool:
    """Whether the body is a JSON object with `name` (chooses the tokenize request's shape)."""
    parsed = json_value(body)  # not json.loads: it raises RecursionError on deep nesting
    return isinstance(parsed, dict) and name in parsed


def _parse(model: type[Any], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc
