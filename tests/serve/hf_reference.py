"""The served model folder through Hugging Face alone (tokenizer, chat template, `generate`,
logits): the reference the live Serve tests compare against."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.actors.reference import hf_greedy, torch_threads


@dataclass(frozen=True)
class Expected:
    """What Hugging Face generates for one prompt."""

    token_ids: list[int]
    text: str
    num_prompt_tokens: int


class HFReference:
    """The served model folder through Hugging Face alone: tokenizer, chat template, generate."""

    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def prompt_ids(self, prompt: str | list[dict[str, str]]) -> list[int]:
        """A text prompt's ids as `tokenizer(prompt)`, or a chat's as
        `apply_chat_template(..., tokenize=True)`."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        chat = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        return list(chat["input_ids"])

    def greedy(self, prompt: str | list[dict[str, str]], max_tokens: int) -> Expected:
        """Greedy tokens of this prompt alone."""
        ids = self.prompt_ids(prompt)
        with torch_threads(1):
            out = hf_greedy(self.model, ids, max_tokens)
        return Expected(out, self.tokenizer.decode(out, skip_special_tokens=True), len(ids))

    @torch.inference_mode()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """log_softmax of the next-token logits after `ids` (a solo forward, float32)."""
        with torch_threads(1):
            logits = self.model(torch.tensor([ids])).logits[0, -1].float()
        return torch.log_softmax(logits, dim=-1)
