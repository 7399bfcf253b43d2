"""What an engine is built from: its model (loaded here, given by the caller, or for a tp x pp
engine the skeleton whose workers load the weights), in the dtype its hardware gets
(actors/dtypes.py), passed by the architecture gate (actors/architectures.py), and its
tokenizer."""

from __future__ import annotations

from typing import Any

import torch

from actors import architectures, loader
from actors.config import EngineConfig
from actors.dtypes import resolve_dtype


def load_for_engine(
    config: EngineConfig,
    model: Any = None,
    tokenizer: Any = None,
    resolved_model: loader.ResolvedModel | None = None,
) -> tuple[Any, Any, torch.dtype]:
    """(model, tokenizer, dtype) for an engine of `config`; `model` and `tokenizer` are the
    caller's when given (a given model keeps its dtype); else read from `resolved_model` (the
    caller resolved `config.model` already: the job's driver), or from `config.model`. A model
    that would run wrong is refused with `UnsupportedModelError`."""
    files = resolved_model if resolved_model is not None else config.model
    if config.world_size > 1:  # workers load the weights; this is the skeleton only
        from actors.parallel.placement import worker_device
        from actors.parallel.weights import check_shapes, meta_model

        if model is not None:
            raise ValueError("tensor/pipeline parallel engines load config.model; pass no model")
        skeleton = meta_model(config, torch.float32, resolved_model)
        check_shapes(skeleton, config.tensor_parallel_size, config.pipeline_parallel_size)
        # the workers' device, not this actor's (it has no GPU)
        dtype = resolve_dtype(config.dtype, worker_device(config))
        model = skeleton.to(dtype)
    elif model is None:
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = resolve_dtype(config.dtype, device)
        model = loader.load_model(files, dtype, device, config.trust_remote_code)
    else:
        dtype = next(model.parameters()).dtype
    architectures.check_model(model, config.tensor_parallel_size, config.pipeline_parallel_size)
    if tokenizer is None:
        tokenizer = loader.load_tokenizer(files, config.trust_remote_code)
    return model, tokenizer, dtype
