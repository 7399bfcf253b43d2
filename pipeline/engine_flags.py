"""The engine's command-line flags, shared by the offline job (pipeline/commands/cli.py) and serving
(pipeline/serve/cli.py), so both speak the same vocabulary (vLLM's CLI names:
`--tensor-parallel-size`/`-tp`, `--pipeline-parallel-size`/`-pp`, `--max-num-batched-tokens`).

    group = add_engine_flags(parser)            # the flags, in one argparse group
    group.add_argument("--served-model-name")   # a caller's own engine-side flags, if any
    engine = engine_config_from_args(parser.parse_args())

Defaults come from `EngineConfig`, so the library, the job and the server share them.
"""

from __future__ import annotations

import argparse
from typing import Any, get_args

from actors.config import (
    DTYPE_NAMES,
    LINEAR_BACKENDS,
    LM_HEAD_SCREENS,
    EngineConfig,
    PlacementStrategy,
)

# The EngineConfig fields a flag sets, by argparse dest (the flag is --dest-with-dashes).
_FIELDS = (
    "model",
    "dtype",
    "lm_head_screen",
    "max_model_len",
    "max_num_batched_tokens",
    "max_num_seqs",
    "chunk_size",
    "kv_cache_memory_gb",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "placement_strategy",
    "worker_num_cpus",
    "generation_config",
    "linear_backend",
)


def add_engine_flags(
    parser: argparse.ArgumentParser,
    title: str = "model and engine",
) -> argparse._ArgumentGroup:
    """Add the model, engine and parallelism flags as one group; return the group so a
    caller can add its own engine-side flags beside them."""
    d = EngineConfig()
    g = parser.add_argument_group(title)
    g.add_argument(
        "--model",
        default=d.model,
        help="'smollm2' (embedded), a local HF folder or a .gguf file, one at a URI (s3://...), "
        "or a hub id org/name[@revision] (downloaded once into the HF cache; HF_HUB_OFFLINE=1: "
        "the cache only)",
    )
    g.add_argument(
        "--dtype",
        choices=list(DTYPE_NAMES),
        default=d.dtype,
        help="weights' and KV cache's type; auto: bfloat16 on GPUs and on CPUs that compute "
        "it natively (AVX-512 BF16, AMX), else float32 (exact against HF's float32)",
    )
    g.add_argument(
        "--linear-backend",
        choices=list(LINEAR_BACKENDS),
        default=d.linear_backend,
        help="the model's linear layers: onednn (CPU, weights packed once; a copy of them in "
        "memory), torch (F.linear), auto: onednn on CPU in float32/bfloat16, else torch",
    )
    g.add_argument(
        "--no-fused-layers",
        action="store_true",
        help="transformers' decoder layers as they are (default: with the onednn linear, q/k/v "
        "as one matmul and Llama-style layers as one function; the same logits, faster)",
    )
    g.add_argument(
        "--lm-head-screen",
        choices=list(LM_HEAD_SCREENS),
        default=d.lm_head_screen,
        help="greedy steps from a bfloat16 LM head, exact after a float32 recompute of the "
        "few candidate tokens: auto (float32 on a CPU with avx512_bf16 or amx), on, off",
    )
    g.add_argument("--max-model-len", type=int, help="context length cap (default: the model's)")
    g.add_argument(
        "--generation-config",
        choices=["auto", "vllm"],
        default=d.generation_config,
        help="auto (the default): the model's generation_config.json sampling values "
        "(temperature, top_p, "
        "top_k, min_p, repetition_penalty) are the defaults of requests that set none, as "
        "vLLM's; vllm: ignore them",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="tokens per engine step (decodes plus prefill chunks)",
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=d.max_num_seqs, help="running requests at most"
    )
    g.add_argument(
        "--chunk-size",
        type=int,
        help="prefill tokens per request per step; with it, prefills leave room for a waiting "
        "request's first chunk (default: the step budget; serving: half of it)",
    )
    g.add_argument(
        "--tpot-target-ms",
        type=float,
        help="aim the step budget at this time per output token: it grows while steps finish "
        "within it and is cut when one does not, up to --max-num-batched-tokens (default: none, "
        "a fixed budget)",
    )
    g.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=d.kv_cache_memory_gb,
        help="KV cache size per engine (split across its pipeline stages)",
    )
    g.add_argument(
        "--no-prefix-caching", action="store_true", help="no block-hash prefix cache in the engine"
    )
    g.add_argument(
        "--no-shared-prefix-attention",
        action="store_true",
        help="decodes read a shared prefix's KV once each (not once per group and step); "
        "default: once per group and step where the C kernel has its AVX-512 tiles",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=d.tensor_parallel_size,
        help="workers per pipeline stage, each with 1/tp of the heads and MLP (one GPU each)",
    )
    g.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=d.pipeline_parallel_size,
        help="pipeline stages, each a contiguous slice of the decoder layers",
    )
    g.add_argument(
        "--placement-strategy",
        choices=get_args(PlacementStrategy),
        default=d.placement_strategy,
        help="Ray placement strategy of an engine's tp x pp bundles (tp alone: STRICT_PACK); "
        "SPREAD puts pipeline stages on different nodes",
    )
    g.add_argument(
        "--worker-num-cpus",
        type=float,
        default=d.worker_num_cpus,
        help="CPUs in each tp x pp worker's bundle",
    )
    return g


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The EngineConfig the flags describe (`overrides` win); ValueError names a bad value.
    Flags a parser did not add keep EngineConfig's defaults."""
    values: dict[str, Any] = {f: getattr(args, f) for f in _FIELDS if hasattr(args, f)}
    if hasattr(args, "no_prefix_caching"):
        values["enable_prefix_caching"] = not args.no_prefix_caching
    if getattr(args, "tpot_target_ms", None) is not None:
        values["tpot_target_s"] = args.tpot_target_ms / 1e3
    if getattr(args, "no_shared_prefix_attention", False):
        values["shared_prefix_attention"] = False
    if hasattr(args, "no_fused_layers"):
        values["fused_layers"] = not args.no_fused_layers
    values.update(overrides)
    return EngineConfig(**values)
