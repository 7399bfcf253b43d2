"""Build a worker's stage from a safetensors checkpoint, reading only its shard.

The model skeleton is made on the meta device (no memory, no random init); the parts this
stage owns are sharded for tensor parallelism, materialised, and filled tensor by tensor with
`safe_open(...).get_slice(name)[rows]`, so a worker never reads another rank's rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from actors import attention, loader
from actors.config import EngineConfig
from actors.parallel.pp import StageModel, layer_range
from actors.parallel.tp import TPShape, shard_layer, shard_slice, tp_shape
from actors.rope import RequestRotary, RopePolicy


def checkpoint_folder(
    config: EngineConfig, resolved_model: loader.ResolvedModel | None = None
) -> Path:
    """The safetensors folder of `config.model` (the embedded default is converted once), or
    of `resolved_model` when the caller resolved it."""
    resolved = resolved_model or loader.resolve_model(config.model)
    source = resolved.files()
    if source.gguf_file is not None:
        raise ValueError(
            f"tensor/pipeline parallel engines load sharded safetensors; {config.model!r} is a "
            "GGUF file (convert it with save_pretrained first)"
        )
    return source.path


def meta_model(
    config: EngineConfig, dtype: torch.dtype, resolved_model: loader.ResolvedModel | None = None
) -> Any:
    """The model's skeleton on the meta device (geometry, config, generation config)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    folder = checkpoint_folder(config, resolved_model)
    hf_config = AutoConfig.from_pretrained(folder, trust_remote_code=config.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            hf_config, dtype=dtype, trust_remote_code=config.trust_remote_code
        )
    if (folder / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval()


def check_shapes(model: Any, tp: int, pp: int) -> None:
    """A clear `ValueError` at start for a model tp x pp cannot split."""
    _parts(model)
    text = model.config.get_text_config()
    tp_shape(text, 0, tp)
    layer_range(text.num_hidden_layers, pp, 0)


def build_stage(
    config: EngineConfig, dtype: torch.dtype, device: torch.device, stage: int, tp_rank: int
) -> tuple[StageModel, TPShape, tuple[int, int]]:
    """This worker's stage with its weights loaded; its TP shape and layer range."""
    model = meta_model(config, dtype)
    attention.register()
    model.set_attn_implementation(attention.ATTN_NAME)
    text = model.config.get_text_config()
    shape = tp_shape(text, tp_rank, config.tensor_parallel_size)
    start, stop = layer_range(text.num_hidden_layers, config.pipeline_parallel_size, stage)
    base, lm_head = _parts(model)
    layers = list(base.layers[start:stop])
    if shape.size > 1:
        for layer in layers:
            shard_layer(layer, shape)
    first, last = stage == 0, stage == config.pipeline_parallel_size - 1
    owned: dict[str, nn.Module] = {f"model.layers.{start + i}": m for i, m in enumerate(layers)}
    if first:
        owned["model.embed_tokens"] = base.embed_tokens
    if last:
        owned["model.norm"] = base.norm
        owned["lm_head"] = lm_head
    for module in owned.values():
        module.to_empty(device=device)
    _load(checkpoint_folder(config), owned, shape, dtype, model.config)
    rotary: nn.Module = type(base.rotary_emb)(config=text).to(device)  # buffers computed
    policy = RopePolicy.of(model)
    if policy is not None:  # longrope / dynamic: per request (actors/rope.py)
        rotary = RequestRotary(rotary, policy)
    result = StageModel(
        layers,
        rotary,
        embed=base.embed_tokens if first else None,
        norm=base.norm if last else None,
        lm_head=lm_head if last else None,
    )
    return result.eval(), shape, (start, stop)


def _parts(model: Any) -> tuple[Any, nn.Module]:
    base = getattr(model, "model", None)
    lm_head = getattr(model, "lm_head", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or lm_head is None or not all(hasattr(base, n) for n in needed):
        raise ValueError(
            f"{type(model).__name__} is not a Llama-style decoder (model.embed_tokens, "
            "model.layers, model.norm, model.rotary_emb, lm_head): tensor/pipeline parallel "
            "engines support those"
        )
    return base, lm_head


def _load(
    folder: Path, owned: dict[str, nn.Module], shape: TPShape, dtype: torch.dtype, hf_config: Any
) -> None:
    files = _weight_files(folder)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    handles: dict[str, Any] = {}
    try:
        for prefix, module in owned.items():
            for local, param in module.named_parameters():
                name = f"{prefix}.{local}"
                key = name
                if key not in files and name == "lm_head.weight" and tied:
                    key = "model.embed_tokens.weight"
                if key not in files:
                    raise ValueError(f"{name} is missing from the checkpoint in {folder}")
                path = files[key]
                if path not in handles:
                    handles[path] = safe_open(str(folder / path), framework="pt", device="cpu")
                view = handles[path].get_slice(key)
                cut = shard_slice(name, shape) if shape.size > 1 else None
                if cut is None:
                    tensor = view[:]
                elif cut[0] == 0:
                    tensor = view[cut[1] : cut[2]]
                else:
                    tensor = view[:, cut[1] : cut[2]]
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(
                        f"{name}: checkpoint shard {tuple(tensor.shape)}, "
                        f"model expects {tuple(param.shape)}"
                    )
                with torch.no_grad():
                    param.copy_(tensor.to(dtype))
    finally:
        handles.clear()


def _weight_files(folder: Path) -> dict[str, str]:
    """Tensor name -> safetensors file (sharded checkpoints have an index)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    single = folder / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"no model.safetensors (or index) in {folder}")
    with safe_open(str(single), framework="pt", device="cpu") as f:
        return {key: single.name for key in f.keys()}
