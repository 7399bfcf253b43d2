"""`usage.prompt_tokens_details.cached_tokens` over HTTP, against first principles: after one
request, a second one that shares a long prefix with it reports as cached exactly the tokens of
the whole KV blocks the two prompts share (block hashes cover whole blocks only, and the last
prompt token is always computed, to sample from its logits)."""

from __future__ import annotations

import uuid

import pytest
import requests
from transformers import AutoTokenizer

from tests.serve.conftest import MODEL, Live

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def complete(live: Live, prompt: str) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    answer = requests.post(live.url("/v1/completions"), json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return dict(answer.json()["usage"])


def test_cached_tokens_are_the_whole_shared_blocks(live: Live) -> None:
    block_size = live.configs["main"].engine.block_size
    tokenizer = AutoTokenizer.from_pretrained(live.model_dir)
    # A marker no other test sends, in the first block: nothing before is shared with these.
    shared = f"Case {uuid.uuid4().hex}: " + " ".join(f"item {i} of the list," for i in range(30))
    first = shared + " and then the end."
    second = shared + " but " + " ".join(f"another part {i}" for i in range(15))
    ids1 = tokenizer.encode(first, add_special_tokens=False)
    ids2 = tokenizer.encode(second, add_special_tokens=False)
    common = common_prefix(ids1, ids2)
    assert common < len(ids1) and common >= 4 * block_size  # a long prefix, diverging early
    expected = block_size * min(common // block_size, (len(ids2) - 1) // block_size)

    usage1 = complete(live, first)
    assert usage1["prompt_tokens"] == len(ids1)
    assert usage1["prompt_tokens_details"]["cached_tokens"] == 0

    usage2 = complete(live, second)
    assert usage2["prompt_tokens"] == len(ids2)
    assert usage2["prompt_tokens_details"]["cached_tokens"] == expected
    assert expected % block_size == 0 and expected > common - block_size
    assert expected < block_size * ((len(ids2) - 1) // block_size)  # not all of it

    # the same prompt again: every whole block but the one holding its last token
    usage3 = complete(live, second)
    whole = block_size * ((len(ids2) - 1) // block_size)
    assert usage3["prompt_tokens_details"]["cached_tokens"] == whole
