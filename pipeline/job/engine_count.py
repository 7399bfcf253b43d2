"""How many engine actors a job starts when `--num-actors auto` (the default): on CPU nodes,
several engines of few threads each where the rows are enough to pay for their start.

Why: one engine's step alternates Python (scheduling, sampling, the detokenizer) with torch
work, and while Python runs the engine's other threads wait; its 2-thread linears also run
at ~93 % of twice one thread. Two engines of one thread on a 2-core machine ran the same
525 Alpaca rows 1.13x faster than one engine of two threads (25.4 s against 28.9 s, float32,
token-identical; docs/benchmarks-job-engine.md). Each engine's start (a process importing
torch and transformers, the model loaded) costs ~5 CPU-seconds while the rows are read and
planned, so a job starts one engine per `ROWS_PER_ENGINE` rows at most: in a 525-row job two
engines still ran 1.08x one (37.2 s against 40.3 s; the first step ~1.8 s later).

A single node's engines run in pairs, as threads of one actor process (`engines_per_actor=
"auto"`, `engine_processes`): they step as fast as in processes of their own, and each pair
imports torch, transformers and Ray Data once instead of twice.

GPU engines, tensor/pipeline-parallel engines and engines with custom resources keep one
actor unless asked: their count is the user's (it follows the devices they hold).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

from pipeline.config import AUTO_ACTORS, DEFAULT_CPUS_PER_ACTOR, JobConfig

ROWS_PER_ENGINE = 256  # sequences per engine at least (one engine below that)
MEMORY_SHARE = 0.5  # of a node's memory, for its engines' weights and KV caches
RUNTIME_BYTES = 2**30  # an engine process beside its weights and KV cache (torch, Python)
# Engines per actor for `engines_per_actor="auto"`: two 1-thread engines stepped as threads of
# one process as fast as in two processes (pipeline/config.py `ComputeConfig`); more threads
# of one process were not measured, and their Python parts take turns on one interpreter lock.
ENGINES_PER_ACTOR = 2
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Node:
    """One alive node: its CPUs and the memory Ray may give its tasks (bytes)."""

    cpus: float
    memory: float


def nodes_now() -> list[Node]:
    """The alive nodes of the connected Ray, else this machine (what a local Ray gets)."""
    import ray

    from actors.build_thread import usable_cores

    if ray.is_initialized():
        return [
            Node(float(n["Resources"].get("CPU", 0.0)), float(n["Resources"].get("memory", 0.0)))
            for n in ray.nodes()
            if n.get("Alive")
        ]
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.7  # Ray's own share
    return [Node(float(usable_cores()), float(memory))]


def engine_bytes(hf_config: Any, dtype_bytes: int, kv_cache_gb: float) -> float | None:
    """One engine's memory: its weights in the engine's dtype (counted from the config, as a
    decoder's embeddings, attention and MLP hold them), its KV cache and the process around
    them; None when the config does not say its shapes."""
    text = getattr(hf_config, "text_config", None) or hf_config
    try:
        hidden, layers, vocab = text.hidden_size, text.num_hidden_layers, text.vocab_size
        inter = text.intermediate_size
    except AttributeError:
        return None
    heads = getattr(text, "num_attention_heads", 1) or 1
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None) or 1
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    mlp = 3 * hidden * inter * experts
    tied = getattr(hf_config, "tie_word_embeddings", True)
    params = layers * (attention + mlp) + vocab * hidden * (1 if tied else 2)
    return params * dtype_bytes + kv_cache_gb * 2**30 + RUNTIME_BYTES


def cpu_engines(
    nodes: list[Node], threads: int, per_engine: float | None, sequences: int | None
) -> tuple[int, str]:
    """How many CPU engines of `threads` torch threads the `nodes` hold (each node: its CPUs
    over the threads, and what half its memory holds), at most one per `ROWS_PER_ENGINE`
    sequences when their count is known; at least one. Returned with the reason, for the log."""
    per_node = []
    for node in nodes:
        count = int(node.cpus) // threads
        if per_engine:
            count = min(count, int(node.memory * MEMORY_SHARE // per_engine))
        per_node.append(max(0, count))
    held = max(1, sum(per_node))
    reason = f"{held} fit the nodes' CPUs ({threads} thread(s) each) and memory"
    if sequences is not None:
        worth = max(1, sequences // ROWS_PER_ENGINE)
        if worth < held:
            return worth, (
                f"{reason}; {sequences} sequences are worth {worth} (one per {ROWS_PER_ENGINE}: "
                "an engine's start costs more than it saves on fewer)"
            )
    return held, reason


def cpus_per_actor(nodes: list[Node], num_actors: int, tokenize_cpus: float) -> float:
    """Each engine actor's CPUs for Ray's scheduling: 0.5, or less where the engines spread
    over the nodes would leave no whole CPU on a node beside the tokenizers (Ray Data lists the
    input in a task of one CPU: `engine_placement.check_cpu_room`). The actors compute on
    `torch_threads` cores whatever they hold (pipeline/stages/engine_actor.py)."""
    largest = max((n.cpus for n in nodes), default=1.0)
    on_one = math.ceil(num_actors / max(1, len(nodes)))
    room = largest - 1.0 - tokenize_cpus
    if on_one * DEFAULT_CPUS_PER_ACTOR <= room:
        return DEFAULT_CPUS_PER_ACTOR
    return max(0.05, math.floor(room / on_one * 1000) / 1000)


def resolve_engines(
    config: JobConfig, sequences: int | None, hf_config: Any, gpus: bool,
    nodes: list[Node] | None = None,
) -> tuple[JobConfig, str | None]:  # fmt: skip
    """`config` with its engine actors counted (`num_actors="auto"`) and the CPUs of several
    CPU engine actors set (`num_cpus_per_actor=None`: `cpus_per_actor`, given counts too),
    and the reason for the count (None when it was given)."""
    compute = config.compute
    reason = None
    count, each = compute.num_actors, compute.engines_each
    if count == AUTO_ACTORS:
        if gpus or config.engine.world_size > 1 or compute.resources:
            count, reason = 1, "one engine for GPU, tensor/pipeline-parallel or custom resources"
        else:
            nodes = nodes if nodes is not None else nodes_now()
            width = DTYPE_BYTES.get(config.engine.dtype, 4)  # "auto" unresolved: float32's
            per_engine = engine_bytes(hf_config, width, config.engine.kv_cache_memory_gb)
            threads = compute.torch_threads or 1
            engines, reason = cpu_engines(nodes, threads, per_engine, sequences)
            count, each = engine_processes(engines, compute.engines_per_actor, len(nodes))
            if each > 1:
                reason += f"; {each} engines in each of {count} actor process(es)"
    cpus = compute.num_cpus_per_actor
    if cpus is None and count * each > 1 and not gpus and config.engine.world_size == 1:
        tokenize = compute.tokenize_num_cpus * compute.num_tokenize_actors
        cpus = cpus_per_actor(nodes or nodes_now(), count * each, tokenize) * each
    compute = replace(compute, num_actors=count, engines_per_actor=each, num_cpus_per_actor=cpus)
    return replace(config, compute=compute), reason


def engine_processes(engines: int, each: int | str, num_nodes: int) -> tuple[int, int]:
    """`engines` auto-counted CPU engines as (actors, engines in each): given `each`, as many
    actors of it as the engines fill (at least one); "auto", pairs on a single node
    (`ENGINES_PER_ACTOR`, when the count is even) and one per actor on several nodes (Ray
    places the actors: a pair split over two nodes' odd cores would leave one idle)."""
    if each == AUTO_ACTORS:
        pairs = num_nodes == 1 and engines % ENGINES_PER_ACTOR == 0
        each = ENGINES_PER_ACTOR if pairs else 1
    each = int(each)
    return max(1, engines // each), each


def count_for_job(
    config: JobConfig, resolved_model: Any, num_rows: int | None, cluster: dict[str, float]
) -> tuple[JobConfig, str | None]:
    """`resolve_engines` for a job: its model's config (no weight read), its sequences (the
    input's rows, None when not counted, times `n`) and whether its engines hold GPUs (as
    `engine_actor_args` decides it, from the `cluster`'s resources: {} without Ray)."""
    from actors.loader import checked_config
    from pipeline.job.engine_placement import workers_use_gpus

    engine = config.engine
    gpus = config.compute.num_gpus_per_actor
    uses_gpus = bool(gpus) or (gpus is None and workers_use_gpus(config, cluster))
    hf = checked_config(
        resolved_model,
        engine.trust_remote_code,
        engine.tensor_parallel_size,
        engine.pipeline_parallel_size,
    )
    sequences = None if num_rows is None else num_rows * config.sampling.n
    return resolve_engines(config, sequences, hf, uses_gpus)
