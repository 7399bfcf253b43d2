"""Prompts to token ids as Hugging Face makes them: the one place every path tokenizes text.

- A text prompt becomes `tokenizer(text).input_ids`: with the special tokens the tokenizer
  adds by default (BOS for Llama-, Mistral- and Gemma-style tokenizers, nothing for SmolLM2),
  so greedy outputs equal `model.generate(**tokenizer(text, return_tensors="pt"))`.
  `add_special_tokens=False` leaves them out (vLLM's option of that name).
- Chat messages become `apply_chat_template(messages, add_generation_prompt=True,
  tokenize=True)`: the template writes BOS where it wants one and nothing is added on top
  (`add_special_tokens=True` adds the tokenizer's special tokens around it, vLLM's chat option).
- Text inside messages never becomes a control token: when a message holds the text of an
  added token (`<|im_end|>`), Hugging Face's `sanitize_control_tokens` encodes it as plain text,
  so a user cannot close their turn and forge a system one. Messages without such text take
  the plain path, so their ids are exactly Hugging Face's. `allow_special_tokens=True` (an
  operator's opt-in: `allow_special_tokens_in_messages` of the job and of Serve) gives Hugging
  Face's default for every message.
- `chat_template` (a Jinja template's text) replaces the tokenizer's own and
  `template_kwargs` (e.g. Qwen3's `enable_thinking`) reach the template as variables, both
  passed to `apply_chat_template` as Hugging Face takes them (vLLM's `chat_template` and
  `chat_template_kwargs`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Messages = Sequence[Mapping[str, Any]]


class ChatTemplateError(ValueError):
    """The chat template (or the sanitizer) rejected the messages."""


def encode_text(tokenizer: Any, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """`tokenizer(text).input_ids` (the tokenizer's special tokens unless turned off)."""
    ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    return [int(t) for t in ids]


def encode_texts(
    tokenizer: Any, texts: Sequence[str], *, add_special_tokens: bool = True
) -> list[list[int]]:
    """`encode_text` of each text, in one batched call."""
    if not texts:
        return []
    batch = tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"]
    return [[int(t) for t in ids] for ids in batch]


def encode_chat(
    tokenizer: Any,
    messages: Messages,
    *,
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
    allow_special_tokens: bool = False,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """`apply_chat_template(messages, add_generation_prompt=..., tokenize=True,
    chat_template=..., **template_kwargs)`, with message text that spells a control token
    encoded as plain text unless `allow_special_tokens`. ChatTemplateError when the template
    rejects the messages."""
    conversation = [dict(m) for m in messages]
    sanitize = not allow_special_tokens and _holds_added_token(tokenizer, conversation)
    extra = _template_args(chat_template, template_kwargs)
    if sanitize:
        extra["sanitize_control_tokens"] = True
    try:
        ids = tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            **extra,
        )
    except Exception as exc:  # noqa: BLE001 (templates raise their own errors for bad roles)
        raise ChatTemplateError(str(exc) or type(exc).__name__) from exc
    out = [int(t) for t in ids]
    if add_special_tokens:
        prefix, suffix = special_tokens_around(tokenizer)
        out = prefix + out + suffix
    return out


def render_chat(
    tokenizer: Any,
    messages: Messages,
    *,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The chat template's text for `messages` (for display; `encode_chat` tokenizes)."""
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **_template_args(chat_template, template_kwargs),
        )
    except Exception as exc:  # noqa: BLE001
        raise ChatTemplateError(str(exc) or type(exc).__name__) from exc
    return str(text)


def _template_args(
    chat_template: str | None, template_kwargs: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The keyword arguments of `apply_chat_template` for a template override and the
    template's own variables (the template sees every extra keyword)."""
    reserved = {  # apply_chat_template's own arguments, which we set
        "conversation", "chat_template", "tokenize", "add_generation_prompt", "return_dict",
        "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
        "sanitize_control_tokens",
    }  # fmt: skip
    clash = sorted(reserved & set(template_kwargs or {}))
    if clash:
        raise ChatTemplateError(f"chat_template_kwargs cannot set {clash}")
    args: dict[str, Any] = dict(template_kwargs or {})
    if chat_template is not None:
        args["chat_template"] = chat_template
    return args


def special_tokens_around(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text by default (e.g. ([BOS], []))."""
    bare = encode_text(tokenizer, "a", add_special_tokens=False)
    full = encode_text(tokenizer, "a")
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return full[:start], full[start + len(bare) :]
    return [], []  # a post-processor that rewrites the text itself: add nothing


def _holds_added_token(tokenizer: Any, conversation: list[dict[str, Any]]) -> bool:
    """Whether any text of the messages spells an added token (the only text the sanitizer
    changes; all other messages are encoded exactly as Hugging Face's plain path does)."""
    added = [t for t in tokenizer.get_added_vocab() if t]
    if not added:
        return False
    return any(token in text for text in _strings(conversation) for token in added)


def _strings(obj: Any) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, Mapping):
        return [s for v in obj.values() for s in _strings(v)]
    if isinstance(obj, list | tuple):
        return [s for v in obj for s in _strings(v)]
    return []
