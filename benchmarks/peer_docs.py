"""The prefix-heavy prompt set of benchmarks/bench_peers.py: shared documents x questions.

Documents are Python standard-library modules' help text (`pydoc`, plain text: on every
machine, no download, the PSF license), each cut at a line break once it reaches the asked
number of tokens; questions ask what one of the module's public names does. Each row is
rendered as `raypack snippets` renders its rows (the system prompt, then the document first,
so every question on a document shares the document as its prompt prefix), and the rows are
shuffled with a fixed seed, as a table's rows arrive in no useful order.
"""

from __future__ import annotations

import importlib
import pydoc
from typing import Any

import numpy as np

from pipeline.commands.snippets import SYSTEM_PROMPT

# Modules with long help texts and many public names, in a fixed order.
MODULES = (
    "argparse", "csv", "itertools", "logging", "pathlib", "random", "re", "statistics",
    "shutil", "subprocess", "threading", "functools", "decimal", "math", "enum", "dataclasses",
)  # fmt: skip


def document(module_name: str, tokenizer: Any, min_tokens: int) -> str:
    """The module's help text, cut at the first line break past `min_tokens` tokens."""
    module = importlib.import_module(module_name)
    text = pydoc.render_doc(module, renderer=pydoc.plaintext)
    lines, kept = text.splitlines(), []
    for line in lines:
        kept.append(line)
        if len(kept) % 8 == 0 and len(tokenizer.encode("\n".join(kept))) >= min_tokens:
            break
    doc = "\n".join(kept)
    if len(tokenizer.encode(doc)) < min_tokens:
        raise ValueError(f"{module_name}'s help text is shorter than {min_tokens} tokens")
    return doc


def questions(module_name: str, count: int) -> list[str]:
    """`count` questions about the module's public names (sorted, so the same every run)."""
    module = importlib.import_module(module_name)
    names = sorted(n for n in dir(module) if not n.startswith("_"))
    if len(names) < count:
        raise ValueError(f"{module_name} has {len(names)} public names, fewer than {count}")
    step = len(names) / count
    picked = [names[int(i * step)] for i in range(count)]
    return [f"What does {name} do, and when would I use it?" for name in picked]


def prefix_messages(
    tokenizer: Any, num_docs: int, doc_tokens: int, per_doc: int, seed: int
) -> list[tuple[str, list[dict]]]:
    """(row id, chat messages) for `num_docs` documents x `per_doc` questions, shuffled."""
    if num_docs > len(MODULES):
        raise ValueError(f"at most {len(MODULES)} documents, got {num_docs}")
    rows = []
    for name in MODULES[:num_docs]:
        doc = document(name, tokenizer, doc_tokens)
        for i, question in enumerate(questions(name, per_doc)):
            content = f"Document:\n{doc}\n\nQuery: {question}\n\nSnippet:"
            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": content},
            ]
            rows.append((f"{name}-{i}", messages))
    order = np.random.default_rng(seed).permutation(len(rows))
    return [rows[int(i)] for i in order]
