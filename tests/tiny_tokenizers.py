"""Tiny byte-level BPE tokenizers built in memory (fixed content, no downloads), one per way
a tokenizer adds special tokens to a text:

- "bos":     `<s> text` (Llama, Mistral, Gemma)
- "bos_eos": `<s> text </s>`
- "none":    `text` (SmolLM2, Qwen)

Each has a ChatML chat template; those that add BOS start it with `{{ bos_token }}` as
Llama-style templates do, so a chat prompt holds BOS once (the template's) and adding the
tokenizer's on top would double it. Any text tokenizes (every byte has a token); `<|im_end|>`
and `<|im_start|>` are special tokens, as in ChatML models. Pair one with
`tests.tiny_models.tiny_model(arch, **model_args(tokenizer))`.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

STYLES = ("bos", "bos_eos", "none")
SPECIALS = ("<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>")
BOS, EOS, PAD, IM_START, IM_END = range(len(SPECIALS))
# A few merges, so text is BPE-merged as real tokenizers do (Ġ is a byte-level space).
MERGES = (("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("o", "n"), ("e", "r"))

_CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(style: str) -> PreTrainedTokenizerFast:
    """The tiny tokenizer of `style` (one of STYLES)."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=list(MERGES)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    if style == "bos":
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)]
        )
    elif style == "bos_eos":
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>",
            pair="<s> $A </s> <s> $B </s>",
            special_tokens=[("<s>", BOS), ("</s>", EOS)],
        )
    template = _CHAT if style == "none" else "{{ bos_token }}" + _CHAT
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=template,
    )


def model_args(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    """tiny_model's vocabulary and special ids for `tokenizer`."""
    return dict(vocab_size=len(tokenizer), bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)


def save_tiny_tokenizer_model(folder: Path, style: str, arch: str = "llama") -> Path:
    """A loadable model folder: a tiny random model sized to the `style` tokenizer, and it."""
    from tests.tiny_models import tiny_model

    tokenizer = tiny_tokenizer(style)
    tiny_model(arch, **model_args(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)
