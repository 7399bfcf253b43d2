"""The architecture gate: which models this engine runs, checked when a model is loaded.

The engine runs a transformers model class whose attention goes through transformers'
`AttentionInterface` (the class says so with `_supports_attention_backend`, what
`PreTrainedModel.is_backend_compatible()` reads, as vLLM's transformers backend checks): only
then does every layer call our paged attention. A class without it (gptj, bloom, falcon, mpt,
codegen...) runs its own attention over the packed step and is silently wrong, so it is
refused. So is a config with a feature no attention backend implements: `REFUSED_FEATURES`,
one entry per feature (a predicate on the config and the reason), so that implementing a
feature is deleting its entry. What passes runs; a model type outside `TESTED_MODEL_TYPES`
(the test matrix, tests/actors/test_architectures.py) runs too, as vLLM runs any class through
its transformers backend, with one warning per engine.

Final logit softcapping (Gemma 2/3's `final_logit_softcapping`) is not refused: transformers
applies it in the model's own LM head, which the engine calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# The model types the test matrix runs token-identical to HF `generate` on every engine path
# (tests/model_matrix.py; tests/actors/test_architectures.py checks the two agree, and
# docs/models.md lists them).
TESTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "granite",
    "starcoder2",
    "gpt_neox",
    "gpt2",
    "qwen2_moe",
    "mixtral",
)

# The model types whose tensor parallel run (tp=2) gives the single-process engine's tokens,
# and those whose pipeline parallel run (pp=2) does (tests/parallel/test_tp_architectures.py).
# The parallel stages run the decoder layers themselves with only the embedding, final norm
# and LM head around them (actors/parallel/pp.py `StageModel`), so a model whose own forward
# does more (Gemma's embedding scale and final softcapping, Granite's embedding and logit
# multipliers, Gemma 3's per-layer rope) is refused there; tensor parallel also needs layers
# the sharding splits (not phi3's fused qkv, olmo2's full-width q/k norms, experts).
TENSOR_PARALLEL_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "starcoder2")
PIPELINE_PARALLEL_MODEL_TYPES = (*TENSOR_PARALLEL_MODEL_TYPES, "phi3", "olmo2")

# Layer kinds whose attention the paged KV cache holds; anything else (linear attention,
# state-space, chunked, hybrid layers) keeps a state of another shape.
_ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})


_NO_INTERFACE = (
    "its attention does not go through transformers' attention interface (the class does "
    "not set _supports_attention_backend), so the engine's paged attention would not run in "
    "its layers"
)


class UnsupportedModelError(ValueError):
    """A model the engine would run wrong: names the model type and the feature."""


@dataclass(frozen=True)
class RefusedFeature:
    """A config feature no attention backend implements: `applies(config)` on the model's
    top-level config (`when` says it in words, for docs/models.md), and the reason given to
    the user."""

    name: str
    applies: Callable[[Any], bool]
    when: str
    reason: str


def _text(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


def _window_matters(config: Any) -> bool:
    """Some layer attends through a sliding window shorter than the model's context."""
    text = _text(config)
    window = getattr(text, "sliding_window", None)
    if not window or getattr(text, "use_sliding_window", True) is False:
        return False
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return False  # e.g. qwen2 below max_window_layers: every layer is full attention
    context = getattr(text, "max_position_embeddings", None)
    return context is None or int(window) < int(context)


def _other_layers(config: Any) -> bool:
    layer_types = getattr(_text(config), "layer_types", None) or ()
    return any(kind not in _ATTENTION_LAYERS for kind in layer_types)


def _alibi(config: Any) -> bool:
    text = _text(config)
    attn = getattr(text, "attn_config", None)  # mpt keeps it there (a dict or a config)
    in_attn = attn.get("alibi") if isinstance(attn, dict) else getattr(attn, "alibi", False)
    return bool(
        getattr(text, "alibi", False)
        or in_attn
        or getattr(text, "position_embedding_type", None) == "alibi"
    )


def _cross_attention(config: Any) -> bool:
    text = _text(config)
    return bool(
        getattr(config, "is_encoder_decoder", False)
        or getattr(text, "add_cross_attention", False)
        or getattr(text, "cross_attention_layers", None)
    )


def _multimodal(config: Any) -> bool:
    return any(
        getattr(config, name, None) is not None
        for name in ("vision_config", "audio_config", "vision_tower", "image_token_index")
    )


# Models whose `sliding_window` transformers applies in the mask alone (found while the
# backends' windows were built: their attention call gets no `sliding_window` keyword).
_WINDOW_IN_MASK_ONLY = ("qwen2_moe", "phimoe")

# One entry per feature; the work that implements a feature deletes its entry (and its test
# in tests/actors/test_architectures.py).
REFUSED_FEATURES: tuple[RefusedFeature, ...] = (
    RefusedFeature(
        "sliding window outside the attention call",
        lambda c: model_type(c) in _WINDOW_IN_MASK_ONLY and _window_matters(c),
        "`sliding_window` in effect on a `qwen2_moe` or `phimoe` model",
        "transformers applies these models' window in their mask only and never passes it to "
        "the attention function, so the engine would attend to the whole context",
    ),
    RefusedFeature(
        "bidirectional attention",
        lambda c: bool(getattr(_text(c), "use_bidirectional_attention", False)),
        "`use_bidirectional_attention` is set (gemma3 embedding variants)",
        "the engine's attention is causal; a bidirectional mask is not followed",
    ),
    RefusedFeature(
        "alibi",
        _alibi,
        "`alibi`, `attn_config.alibi` or `position_embedding_type=alibi`",
        "ALiBi position biases are not applied by any attention backend",
    ),
    RefusedFeature(
        "cross-attention",
        _cross_attention,
        "`is_encoder_decoder`, `add_cross_attention` or `cross_attention_layers` (mllama)",
        "encoder-decoder and cross-attention layers need an encoder's states; the engine runs "
        "decoder-only models",
    ),
    RefusedFeature(
        "multimodal",
        _multimodal,
        "a `vision_config` or `audio_config` (gemma3, llava, qwen2_vl...)",
        "a vision or audio model: the engine takes text prompts only and the text-only path "
        "of such a class is not tested (use its text-only checkpoint, e.g. gemma3_text)",
    ),
    RefusedFeature(
        "non-attention layers",
        _other_layers,
        "`layer_types` beyond full and sliding attention (jamba, qwen3_next, granitemoehybrid, "
        "llama4's chunked attention)",
        "linear-attention, state-space or chunked-attention layers keep a state the paged "
        "KV cache does not hold",
    ),
    RefusedFeature(
        "multi-head latent attention",
        lambda c: getattr(_text(c), "kv_lora_rank", None) is not None,
        "`kv_lora_rank` is set (deepseek_v2/v3)",
        "MLA (kv_lora_rank) caches a compressed latent, not per-head K/V",
    ),
    RefusedFeature(
        "attention sinks",
        lambda c: getattr(c, "model_type", None) == "gpt_oss",
        "model type `gpt_oss`",
        "learned attention sinks (gpt_oss) add a per-head term to the softmax no attention "
        "backend applies",
    ),
)


def model_type(config: Any) -> str:
    """The config's `model_type` ('?' when it has none)."""
    return str(getattr(config, "model_type", None) or "?")


def causal_lm_class(config: Any) -> type | None:
    """The class `AutoModelForCausalLM` makes for `config`, without loading anything; None
    for a config it does not map (remote code: checked on the loaded model instead)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    found: Any = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return found if isinstance(found, type) else None


def refusals(config: Any) -> list[RefusedFeature]:
    """The entries of `REFUSED_FEATURES` that apply to `config`."""
    return [feature for feature in REFUSED_FEATURES if feature.applies(config)]


def check_config(config: Any, model_class: type | None = None) -> None:
    """Raise `UnsupportedModelError` naming the model type and the feature when the engine
    would run this model wrong: a `model_class` whose attention does not go through
    transformers' attention interface, or a refused config feature."""
    problems = [(f.name, f.reason) for f in refusals(config)]
    named = ""
    if model_class is not None:
        named = f" ({model_class.__name__})"
        if not getattr(model_class, "_supports_attention_backend", False):
            problems.insert(0, ("attention interface", _NO_INTERFACE))
    if problems:
        found = "; ".join(f"{name}: {reason}" for name, reason in problems)
        raise UnsupportedModelError(
            f"model type {model_type(config)!r}{named} is not supported: {found}"
        )


def check_parallel(config: Any, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    """Raise `UnsupportedModelError` for a tensor (pipeline) parallel engine of a model type
    outside `TENSOR_PARALLEL_MODEL_TYPES` (`PIPELINE_PARALLEL_MODEL_TYPES`)."""
    kind = model_type(config)
    for name, size, verified in (
        ("tensor", tensor_parallel_size, TENSOR_PARALLEL_MODEL_TYPES),
        ("pipeline", pipeline_parallel_size, PIPELINE_PARALLEL_MODEL_TYPES),
    ):
        if size > 1 and kind not in verified:
            raise UnsupportedModelError(
                f"model type {kind!r} is not supported with {name} parallel ({name}_parallel_"
                f"size {size}): the parallel stages run the decoder layers with only the "
                "embedding, final norm and LM head around them, and this model's own forward "
                f"or layer layout is not verified there (verified: {', '.join(verified)}); "
                f"run it with {name}_parallel_size 1"
            )


def check_model(model: Any, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> None:
    """`check_config` on a loaded model (its class and config) and `check_parallel`, then one
    warning when its model type is outside the tested matrix. The engine calls this once per
    load."""
    check_config(model.config, type(model))
    check_parallel(model.config, tensor_parallel_size, pipeline_parallel_size)
    kind = model_type(model.config)
    if kind not in TESTED_MODEL_TYPES:
        logger.warning(
            "model type %r is not in raypack's tested architectures (docs/models.md); it "
            "passes the architecture checks and runs, but its outputs are not verified "
            "against Hugging Face generate",
            kind,
        )
