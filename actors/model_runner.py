"""Turn a scheduled step into one flat model input, run the model, return logits.

The step is ONE sequence: each scheduled request contributes its next `num_new` tokens, with
positions continuing after its cached tokens (`packing.layout.flat_layout`) and K/V slots from
its block table (`packing.layout.slot_mapping`). Decodes come first so attention can batch
them. Logits are computed only at the last row of each request that samples this step; on a step
whose sampling rows are all plain greedy, with `lm_head_screen`, the runner returns their
tokens instead (`actors.screened_head`: a bfloat16 head screens, float32 decides); so it does
for bfloat16 logits with `fused_kernels` (their argmax in one compiled pass, the same tokens).

`prepare` (layout -> tensors) and `forward` (model call) are separate on purpose. The
padded and Prepacking prefills the benchmarks compare against live in `benchmarks/modes.py`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from actors import attention, cpu_linear, dtypes, llama_layer, rotary_attention, screened_head
from actors.config import EngineConfig
from actors.kernels import fused
from actors.kv_cache import allocate_kv_tensors
from actors.request import Request
from actors.rope import RequestRotary, RopePolicy, rotary_module, token_rope_lens
from actors.scheduler import SchedulerOutput
from actors.screened_head import GreedyTokens, ScreenedHead
from actors.step_layout import lay_out
from packing.layout import slot_mapping

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInput:
    """One step's tensors."""

    input_ids: torch.Tensor  # [1, num_tokens]
    position_ids: torch.Tensor  # [1, num_tokens]
    logits_indices: torch.Tensor  # [num_sampling] rows whose logits are needed
    sampling: list[Request]  # the requests those rows belong to, in the same order
    attn: attention.AttentionMetadata
    rope_lens: torch.Tensor | None = None  # [num_tokens] length-dependent rope only
    screen: bool = False  # every sampling row plain greedy: tokens from the screened head
    greedy: bool = False  # every sampling row plain greedy (`screened_head.screenable`)


def model_geometry(model: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a transformers decoder."""
    cfg = model.config.get_text_config()
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, head_dim


class ModelRunner:
    """Owns the model and the KV tensors; executes scheduled steps."""

    def __init__(
        self,
        model: Any,
        config: EngineConfig,
        num_blocks: int,
        weights_of: ModelRunner | None = None,
    ) -> None:
        """`weights_of`: another runner in this process on the same model and config, whose
        set-up (packed linears, fused layers, screened head) this one uses as it is; only the
        KV tensors and the attention backend are this runner's own. Each step's state travels
        in the model call's arguments, so two threads can run the shared model at once."""
        self.model = model
        self.config = config
        self.block_size = config.block_size
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        num_layers, num_kv_heads, head_dim = model_geometry(model)
        self.kv_caches = allocate_kv_tensors(
            num_layers,
            num_blocks,
            self.block_size,
            num_kv_heads,
            head_dim,
            self.dtype,
            self.device,
        )
        # Chosen once, from the config and the cache's device and dtype (`actors.attention`).
        self.attention_backend = attention.make_backend(
            config.attention_backend,
            self.kv_caches,
            config.shared_prefix_attention,
            config.shared_prefix_min_keys,
        )
        attention.register()
        if weights_of is not None:
            self._share_setup(weights_of)
            return
        model.set_attn_implementation(attention.ATTN_NAME)
        self.rotary = _request_rotary(model)
        self.linear_backend = cpu_linear.resolve(
            config.linear_backend, self.device, self.dtype, cpu_linear.linear_weight_bytes(model)
        )
        # Compiled element-wise kernels (actors/kernels/fused.py): the layers' norms and
        # rotary, and the greedy argmax of bfloat16 logits
        self.fused_ops = fused.fused_ops(self.device, self.dtype) if config.fused_kernels else None
        self.greedy_argmax = (
            self.fused_ops.argmax
            if self.fused_ops is not None and self.dtype == torch.bfloat16
            else None
        )
        # The model runs as this config says, whatever an earlier engine on it did.
        llama_layer.uninstall(model)
        rotary_attention.uninstall(model)
        cpu_linear.unpack_linears(model)
        if self.linear_backend == "onednn":
            cpu_linear.pack_linears(model, fuse=config.fused_layers)
            if config.fused_layers:
                rotary_attention.install(model, self.fused_ops)
                llama_layer.install(model, self.fused_ops)
        self.screened_head: ScreenedHead | None = None
        cpu = dtypes.cpu_info()
        if screened_head.wanted(config.lm_head_screen, model, self.device, self.dtype, cpu):
            self.screened_head = ScreenedHead(model.get_output_embeddings(), cpu_linear.BATCH_HINT)
            logger.info("greedy steps take the screened bfloat16 LM head (lm_head_screen)")

    def _share_setup(self, other: ModelRunner) -> None:
        """Run `other`'s model as `other` set it up (its packed weights are not copied). The
        engine checked it can be shared (`LLMEngine.shares_weights`, the same config)."""
        assert other.model is self.model and other.rotary is None
        self.rotary = None
        self.linear_backend = other.linear_backend
        self.fused_ops = other.fused_ops
        self.greedy_argmax = other.greedy_argmax
        head = other.screened_head
        self.screened_head = head.twin() if head is not None else None

    def prepare(self, sched: SchedulerOutput) -> ModelInput:
        """Lay the step out as one flat sequence (decodes first; `actors.step_layout`)."""
        step = lay_out(sched)
        tables = [r.block_ids for r in step.requests]
        slots = slot_mapping(step.num_cached, step.num_new, tables, self.block_size)
        batch = attention.StepBatch(
            step.num_cached,
            step.num_new,
            tables,
            step.layout.cu_seqlens_q,
            step.num_decodes,
            self.block_size,
        )
        meta = attention.AttentionMetadata.build(self.attention_backend, batch, slots)
        rope_lens = None
        if self.rotary is not None:  # longrope / dynamic: each request's own frequencies
            lens = np.fromiter((r.rope_len for r in step.requests), np.int64, len(step.requests))
            rope_lens = torch.from_numpy(
                token_rope_lens(lens, step.num_new, step.layout.positions)
            ).to(self.device)
        greedy = all(screened_head.screenable(r) for r in step.sampling)
        return ModelInput(
            input_ids=torch.tensor(step.input_ids, dtype=torch.long, device=self.device)[None],
            position_ids=torch.from_numpy(step.layout.positions).to(self.device)[None],
            logits_indices=torch.tensor(step.logits_rows, dtype=torch.long, device=self.device),
            sampling=step.sampling,
            attn=meta,
            rope_lens=rope_lens,
            screen=self.screened_head is not None and greedy,
            greedy=greedy,
        )

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (a shared prefix's partial block)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    @torch.inference_mode()
    def forward(self, inputs: ModelInput) -> torch.Tensor | GreedyTokens:
        """Run the model; float32 logits `[num_sampling, vocab]`, or on a screened step (or a
        plain greedy one with bfloat16 logits and `fused_ops`) the greedy tokens themselves."""
        if self.rotary is not None:
            self.rotary.for_step(inputs.rope_lens)
        kwargs = {
            "input_ids": inputs.input_ids,
            "position_ids": inputs.position_ids,
            "use_cache": False,
            attention.ATTN_KWARG: inputs.attn,
        }
        try:
            if inputs.screen and self.screened_head is not None:
                out = self.model.get_decoder()(**kwargs)
            else:
                out = self.model(logits_to_keep=inputs.logits_indices, **kwargs)
        finally:
            if self.rotary is not None:
                self.rotary.for_step(None)
        if inputs.screen and self.screened_head is not None:
            hidden = out.last_hidden_state[0, inputs.logits_indices]
            return GreedyTokens(self.screened_head.argmax(hidden))
        logits: torch.Tensor = out.logits[0]
        if inputs.greedy and self.greedy_argmax is not None:  # bfloat16: no float32 copy
            tokens = self.greedy_argmax(logits)
            if tokens is not None:
                return GreedyTokens(tokens)
        return logits.float()

    def execute(self, sched: SchedulerOutput) -> tuple[list[Request], torch.Tensor | GreedyTokens]:
        """Copy blocks, run the step; the sampling requests and their logits."""
        self.copy_blocks(sched.block_copies)
        inputs = self.prepare(sched)
        return inputs.sampling, self.forward(inputs)

    # The executor interface the engine drives (`StepRunner`): in one process a step runs
    # when it is submitted, and its handle is its result.
    max_in_flight = 1

    def submit(
        self, sched: SchedulerOutput, block_offset: int = 0
    ) -> tuple[list[Request], torch.Tensor | GreedyTokens]:
        """Run one step now (one KV pool: `block_offset` is 0)."""
        assert block_offset == 0, "a single-process runner has one KV pool"
        return self.execute(sched)

    def collect(
        self, handle: tuple[list[Request], torch.Tensor | GreedyTokens]
    ) -> tuple[list[Request], torch.Tensor | GreedyTokens]:
        """The submitted step's sampling requests and logits (or screened greedy tokens)."""
        return handle

    def shutdown(self) -> None:
        """Nothing to release (the model is the caller's)."""


def _request_rotary(model: Any) -> RequestRotary | None:
    """Put a `RequestRotary` in place of the model's rotary embedding when its frequencies
    depend on the sequence length (actors/rope.py); None (today's path) otherwise."""
    policy = RopePolicy.of(model)
    if policy is None:
        return None
    decoder = model.get_decoder()
    current = rotary_module(model)
    assert current is not None, "RopePolicy.of checks the model has a rotary_emb"
    if not isinstance(current, RequestRotary):
        current = RequestRotary(current, policy)
        decoder.rotary_emb = current
    return current


class StepRunner(Protocol):
    """What the engine drives, the executor: a single-process `ModelRunner`, or a tensor/
    pipeline-parallel `actors.parallel.executor.ParallelExecutor` (or its compiled graph).
    `submit` starts a step on the request set whose KV blocks start at `block_offset`;
    `collect` waits for it; up to `max_in_flight` steps are submitted and not yet collected."""

    max_in_flight: int

    def submit(self, sched: SchedulerOutput, block_offset: int = 0) -> Any: ...

    def collect(self, handle: Any) -> tuple[list[Request], torch.Tensor | GreedyTokens]: ...

    def shutdown(self) -> None: ...
