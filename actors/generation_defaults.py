"""The model's own sampling defaults: its `generation_config.json`'s temperature, top_p,
top_k, min_p and repetition_penalty, applied where a request did not set them, as vLLM does
with `--generation-config auto` (its default; `get_diff_sampling_param`: the values that differ
from transformers' `GenerationConfig` defaults, whatever `do_sample` says). `vllm` ignores them
(vLLM's own defaults). EOS ids are not here: the engine always stops at the generation
config's EOS (actors/limits.py).

Greedy stays greedy when asked: a request (or job flag) that sets `temperature=0` keeps it.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

logger = logging.getLogger(__name__)

GenerationConfigMode = Literal["auto", "vllm"]
GENERATION_CONFIG_MODES = ("auto", "vllm")
# generation_config.json's name -> SamplingParams' (the same names; vLLM's list, without
# max_new_tokens: a request's max_tokens default stays ours)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(generation_config: Any, mode: GenerationConfigMode) -> dict[str, Any]:
    """The sampling fields `generation_config` (a transformers `GenerationConfig`, or None)
    sets away from transformers' defaults; {} with mode `vllm` or without one."""
    if mode not in GENERATION_CONFIG_MODES:
        raise ValueError(
            f"generation_config must be one of {GENERATION_CONFIG_MODES}, got {mode!r}"
        )
    if mode == "vllm" or generation_config is None:
        return {}
    diff = generation_config.to_diff_dict()
    return {name: diff[name] for name in SAMPLING_FIELDS if diff.get(name) is not None}


def folder_defaults(model: str, mode: GenerationConfigMode) -> dict[str, Any]:
    """`sampling_defaults` of `model` (a name `actors.loader.resolve` takes) read from its
    folder's generation_config.json without loading the model (the job's driver, before Ray);
    {} for a model without one (a GGUF file)."""
    if mode == "vllm":
        return {}
    from transformers import GenerationConfig

    from actors.loader import resolve_model

    source = resolve_model(model).source
    if source.gguf_file is not None or not (source.path / "generation_config.json").exists():
        return {}
    return sampling_defaults(GenerationConfig.from_pretrained(source.path), mode)


def log_choice(model: str, mode: GenerationConfigMode, defaults: dict[str, Any]) -> None:
    """One line saying which sampling defaults requests get (once per engine)."""
    if mode == "vllm":
        logger.info("--generation-config vllm: %s's generation_config.json is ignored", model)
    elif defaults:
        logger.info(
            "sampling defaults from %s's generation_config.json (where a request sets none; "
            "--generation-config vllm ignores them): %s",
            model,
            defaults,
        )
    else:
        logger.info("%s's generation config sets no sampling defaults", model)


def engine_defaults(model: Any, config: Any) -> tuple[dict[str, Any], Any]:
    """An engine's sampling defaults (the fields, and the `SamplingParams` a request without
    params gets) from its loaded `model`'s generation config, as `config.generation_config`
    says; logged once. An out-of-range value in the file is a ValueError naming it."""
    from actors.config import SamplingParams

    defaults = sampling_defaults(
        getattr(model, "generation_config", None), config.generation_config
    )
    try:
        params = SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(
            f"{config.model}'s generation_config.json: {exc} (--generation-config vllm ignores it)"
        ) from exc
    log_choice(config.model, config.generation_config, defaults)
    return defaults, params
