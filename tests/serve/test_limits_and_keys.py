"""jobs/serve.py's command line down to the request checks, without Ray: `--max-prompt-tokens`
makes a longer prompt a 400 (context_length_exceeded) and `--api-keys-env` / `--api-keys-file`
name where keys come from; a missing key file is an error, never an open server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.loader import load_tokenizer
from pipeline.commands.serve import parse_args
from pipeline.serve.auth import load_api_keys
from pipeline.serve.cli import serve_config_from_args
from pipeline.serve.errors import APIError
from pipeline.serve.service import OpenAIService

ROOT = Path(__file__).parents[2]
CONTEXT = 512


def serve_args(*flags: str):  # noqa: ANN201
    """`raypack serve`'s (and jobs/serve.py's) parse_args on these flags."""
    return parse_args(["--model", "smollm2", *flags])


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return load_tokenizer("smollm2")


def body(prompt: str | list[int], max_tokens: int = 2) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens}).encode()


def test_max_prompt_tokens_flag_is_a_400(tokenizer) -> None:  # noqa: ANN001
    config = serve_config_from_args(
        serve_args("--max-prompt-tokens", "8", "--served-model-name", "m")
    )
    assert config.max_prompt_tokens == 8
    service = OpenAIService(config, None, tokenizer, CONTEXT, len(tokenizer))  # type: ignore[arg-type]
    assert len(service.prepare_completion(body(list(range(10, 18)))).prompt_token_ids) == 8
    text = "one two three four five six seven eight nine"
    assert len(tokenizer.encode(text, add_special_tokens=False)) == 9
    for prompt in (list(range(10, 19)), text):
        with pytest.raises(APIError) as info:
            service.prepare_completion(body(prompt))
        assert info.value.status == 400
        assert info.value.detail.code == "context_length_exceeded"
        assert info.value.detail.param == "prompt"
        assert "at most 8" in info.value.detail.message

    # without the flag the model's context is the bound (minus one token to generate)
    config = serve_config_from_args(serve_args("--served-model-name", "m"))
    service = OpenAIService(config, None, tokenizer, CONTEXT, len(tokenizer))  # type: ignore[arg-type]
    assert len(service.prepare_completion(body([5] * 511, 1)).prompt_token_ids) == 511
    with pytest.raises(APIError, match="at most 511"):
        service.prepare_completion(body([5] * CONTEXT, 1))


def test_api_keys_from_the_environment_and_a_file(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setenv("RPX_TEST_KEYS", " sk-a, sk-b ,, ")
    config = serve_config_from_args(serve_args("--api-keys-env", "RPX_TEST_KEYS"))
    assert config.api_keys_env == "RPX_TEST_KEYS" and config.api_keys_file is None
    assert load_api_keys(config.api_keys_env, config.api_keys_file) == {"sk-a", "sk-b"}

    keys = tmp_path / "keys.txt"
    keys.write_text("# comment\nsk-file  # trailing comment\n\n")
    config = serve_config_from_args(
        serve_args("--api-keys-env", "RPX_TEST_KEYS", "--api-keys-file", str(keys))
    )
    assert load_api_keys(config.api_keys_env, config.api_keys_file) == {"sk-a", "sk-b", "sk-file"}

    monkeypatch.delenv("RPX_TEST_KEYS")
    assert load_api_keys("RPX_TEST_KEYS", None) == frozenset()  # unset: an open server


def test_missing_key_file_is_an_error(tmp_path) -> None:  # noqa: ANN001
    missing = tmp_path / "no-such-keys.txt"
    config = serve_config_from_args(serve_args("--api-keys-file", str(missing)))
    with pytest.raises(FileNotFoundError, match="no-such-keys.txt"):
        load_api_keys(config.api_keys_env, config.api_keys_file)
