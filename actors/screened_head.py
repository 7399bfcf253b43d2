"""Exact greedy tokens from a bfloat16-screened LM head (float32 engines on a CPU with native
bf16; issue 28).

A greedy row needs only the argmax of its float32 logits. The 49,152-wide LM head is the
largest matmul of a small model's step (~1.5 s of a float32 `generate` over the Alpaca set,
docs/benchmarks-peers.md), and oneDNN's bfloat16 matmul runs it ~2.5x faster on a CPU with
AVX-512 BF16. So the head runs in bfloat16 on a packed bf16 copy of its weight, a rigorous
bound on each logit's error keeps every token that could still be the float32 argmax, those
candidates' logits are recomputed in float32, and the argmax among them (lowest index on
ties, as `torch.argmax`) is the float32 argmax up to the order float32 sums its terms (which
already differs between oneDNN's matmul and Hugging Face's). A row whose candidate set is
huge, or whose values are not finite, is computed by the full float32 head instead.

The error bound, per row h (float32 hidden state, K = hidden size) and vocabulary row w_j
(float32), with h_b, w_b their bfloat16 roundings, y_j the bfloat16 matmul's output and r_j
any float32 dot product of h and w_j (the reference; oneDNN's or ours, any summation order):
  - inputs: h_b.w_b - h.w = (h_b - h).w_b + h.(w_b - w) (exact), so by Cauchy-Schwarz
    |h_b.w_b - h.w| <= ||h_b - h|| ||w_b,j|| + ||h|| ||w_b,j - w_j||; both differences are
    known exactly (measured per row for h, precomputed for W), not bounded by 2^-8.
  - the bf16 matmul accumulates the exact bf16 x bf16 products in float32: whatever the order
    or blocking, |sum - h_b.w_b| <= gamma_n sum|h_b||w_b| <= gamma_n ||h_b|| ||w_b,j||,
    gamma_n = n u32 / (1 - n u32), u32 = 2^-24; taken with n = 2K (the AVX-512 BF16 dot
    instruction rounds per pair; denormal products are flushed: < K 2^-126, an absolute
    2^-100 covers it).
  - its output is rounded to bfloat16: |y_j - sum| <= u |y_j|, u = 2^-8 (Higham 2.5).
  - the float32 reference: |r_j - h.w| <= gamma_K ||h|| ||w_j||.
So |y_j - r_j| <= A + u |y_j| =: B_j, where A takes the max over j of the norms (one number
per row; every term x1.05 for the float64 arithmetic of the bound itself). A token j with
y_j + B_j < max_k (y_k - B_k) has r_j < r_k for that k: it cannot be the argmax. Since
y + u|y| and y - u|y| are increasing in y, the candidates are the j with y_j >= one
threshold per row, rounded down to bfloat16 (so the comparison keeps a superset).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch

from actors.cpu_linear import onednn_runs
from actors.request import Request

logger = logging.getLogger(__name__)

# Architectures whose causal-LM logits are exactly `lm_head(final hidden state)` (no soft
# capping or scaling after it), checked against transformers' modeling code.
MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3"})
# Candidates above this in one row: that row takes the full float32 head.
MAX_CANDIDATES = 256
BLOCK = 256  # columns per block of the candidate search
_U_BF16 = 2.0**-8
_U_FP32 = 2.0**-24
_MARGIN = 1.05
_TINY = 2.0**-100


def gamma(n: int) -> float:
    """Higham's gamma_n for float32: the relative error bound of an n-term sum."""
    return n * _U_FP32 / (1 - n * _U_FP32)


@dataclass
class ScreenStats:
    """What screening did over an engine's life (for benchmarks and logs)."""

    steps: int = 0
    rows: int = 0
    candidates: int = 0  # summed over the rows that were screened, fallbacks not counted
    fallback_rows: int = 0

    def summary(self) -> dict[str, float]:
        """Counts and the mean candidates per screened row."""
        screened = self.rows - self.fallback_rows
        return {
            "steps": self.steps,
            "rows": self.rows,
            "fallback_rows": self.fallback_rows,
            "mean_candidates_per_row": self.candidates / screened if screened else 0.0,
            "mean_candidates_per_step": self.candidates / self.steps if self.steps else 0.0,
        }


@dataclass(frozen=True)
class GreedyTokens:
    """A step's sampled tokens, one per sampling row, already chosen (screened greedy)."""

    token_ids: torch.Tensor  # [num_sampling] long


def screenable(req: Request) -> bool:
    """Whether `req`'s next token is the plain argmax of its float32 logits: greedy, no
    logprobs, penalties, logit bias or grammar, and past min_tokens (whose EOS ban would
    change the argmax)."""
    p = req.params
    return (
        p.greedy
        and p.logprobs is None
        and not p.penalised
        and not p.logit_bias
        and p.guided_decoding is None
        and req.num_output_tokens >= p.min_tokens
    )


def wanted(choice: str, model: Any, device: torch.device, dtype: torch.dtype, cpu: Any) -> bool:
    """`EngineConfig.lm_head_screen` for this engine: "auto" screens float32 models on a CPU
    with native bfloat16 (`cpu.native_bf16`); "on" wherever it can run (a CPU float32 model
    of a listed architecture with a bias-free LM head, on a CPU where oneDNN runs bfloat16:
    `cpu_linear.onednn_runs`); "off" never."""
    if choice == "off":
        return False
    head = model.get_output_embeddings()
    possible = (
        device.type == "cpu"
        and dtype == torch.float32
        and model.config.model_type in MODEL_TYPES
        and isinstance(head, torch.nn.Linear)
        and head.bias is None
        and onednn_runs(torch.bfloat16)
    )
    if choice == "on":
        if not possible:
            logger.warning(
                "lm_head_screen='on' does not apply to this model (a CPU float32 model of "
                "%s with a bias-free LM head, on a CPU where oneDNN runs bfloat16): the "
                "full float32 head runs",
                sorted(MODEL_TYPES),
            )
        return possible
    return possible and bool(cpu.native_bf16)


def row_norm_maxima(
    weight: torch.Tensor, w_b: torch.Tensor, chunk_rows: int = 4096
) -> tuple[float, float, float]:
    """The largest row norm of `w_b`, of `w_b - weight` and of `weight`, in float64, a chunk of
    rows at a time: a float64 copy of a whole head is 8 bytes a weight (three of them held
    ~680 MB at once for SmolLM2's head, ~12 GB for a 128k x 4,096 one)."""
    maxima = [0.0, 0.0, 0.0]
    for start in range(0, weight.shape[0], chunk_rows):
        w64 = weight[start : start + chunk_rows].double()
        wb64 = w_b[start : start + chunk_rows].double()
        norms = (wb64.norm(dim=1), (wb64 - w64).norm(dim=1), w64.norm(dim=1))
        maxima = [max(m, float(n.max())) for m, n in zip(maxima, norms, strict=True)]
    return maxima[0], maxima[1], maxima[2]


class ScreenedHead:
    """The LM head's bf16 copy and norms, packed once; `argmax` of float32 hidden rows."""

    def __init__(self, head: torch.nn.Linear, batch_hint: int = 128) -> None:
        self.head = head  # its forward: the full float32 rows (oneDNN-packed when the runner
        # packed it)
        weight = head.weight.detach()
        self.weight = weight  # [vocab, K] float32, the rows candidates are recomputed from
        w_b = weight.to(torch.bfloat16)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w_b, batch_hint)
        k = weight.shape[1]
        self._wb_max, self._dw_max, self._w_max = row_norm_maxima(weight, w_b)
        self._gamma_acc = gamma(2 * k)
        self._gamma_ref = gamma(k)
        self.stats = ScreenStats()

    def twin(self) -> ScreenedHead:
        """The same packed weights and norms with counters of its own (a second engine on
        the same model in this process)."""
        other = copy.copy(self)
        other.stats = ScreenStats()
        return other

    def error_bound(self, hidden: torch.Tensor, h_b: torch.Tensor) -> torch.Tensor:
        """A per row (float64 `[rows]`): |y_j - r_j| <= A + u |y_j| for every j (module doc)."""
        h64 = hidden.double()
        hb64 = h_b.double()
        h_norm = h64.norm(dim=1)
        terms = (
            (hb64 - h64).norm(dim=1) * self._wb_max
            + h_norm * self._dw_max
            + self._gamma_acc * hb64.norm(dim=1) * self._wb_max
            + self._gamma_ref * h_norm * self._w_max
        )
        bound: torch.Tensor = _MARGIN * terms + _TINY
        return bound

    @torch.inference_mode()
    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """The float32 argmax of `hidden @ W.T` per row (`hidden` `[rows, K]` float32)."""
        hidden = hidden.contiguous()
        rows = hidden.shape[0]
        h_b = hidden.to(torch.bfloat16)
        y = torch.ops.mkldnn._linear_pointwise(h_b, self.packed, None, "none", [], "")
        block_max = _block_max(y)
        top = block_max.amax(dim=1).double()
        a = self.error_bound(hidden, h_b)
        cu = _U_BF16 * _MARGIN
        lower_top = top - cu * top.abs()
        t = lower_top - 2 * a  # upper(y_j) >= t keeps j; upper(y) = y + cu|y|
        t = torch.where(t >= 0, t / (1 + cu), t / (1 - cu))
        # Rounded down to bfloat16: round-to-nearest of t - 2^-7|t| is below t.
        t_b = (t - t.abs() * 2.0**-7).to(torch.bfloat16)
        # Blocks holding a candidate first (a pass over y is what screening costs; the block
        # maxima are one, and the candidates are found in the few blocks that reach t).
        blk_rows, blks = (block_max >= t_b[:, None]).nonzero(as_tuple=True)
        blk_counts = torch.bincount(blk_rows, minlength=rows)
        bad = (blk_counts == 0) | (blk_counts > MAX_CANDIDATES) | ~torch.isfinite(t)
        keep = ~bad[blk_rows]
        row_idx, cols = _in_blocks(y, t_b, blk_rows[keep], blks[keep])
        counts = torch.bincount(row_idx, minlength=rows)
        bad |= counts > MAX_CANDIDATES
        keep = ~bad[row_idx]
        row_idx, cols = row_idx[keep], cols[keep]
        vals = (self.weight[cols] * hidden[row_idx]).sum(dim=1)
        nonfinite = ~torch.isfinite(vals)
        if bool(nonfinite.any()):
            bad[row_idx[nonfinite]] = True
        best = torch.full((rows,), float("-inf")).scatter_reduce(0, row_idx, vals, "amax")
        at_best = vals == best[row_idx]
        vocab = self.weight.shape[0]
        tokens: torch.Tensor = torch.full((rows,), vocab, dtype=torch.long).scatter_reduce(
            0, row_idx[at_best], cols[at_best], "amin"
        )
        fallback = bad.nonzero(as_tuple=True)[0]
        if len(fallback):
            full: torch.Tensor = self.head(hidden[fallback])
            tokens[fallback] = full.float().argmax(dim=-1)
        self.stats.steps += 1
        self.stats.rows += rows
        self.stats.fallback_rows += len(fallback)
        self.stats.candidates += int(counts.sum()) - int(counts[bad].sum())
        return tokens


def _block_max(y: torch.Tensor) -> torch.Tensor:
    """The max of each `BLOCK` columns of `y` `[rows, vocab]` (the last block may be
    shorter): `[rows, ceil(vocab / BLOCK)]`."""
    rows, vocab = y.shape
    full = vocab // BLOCK
    parts = [y.as_strided((rows, full, BLOCK), (y.stride(0), BLOCK, 1)).amax(dim=2)]
    if vocab % BLOCK:
        parts.append(y[:, full * BLOCK :].amax(dim=1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _in_blocks(
    y: torch.Tensor, t_b: torch.Tensor, rows: torch.Tensor, blocks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every y[row, column] >= t_b[row] in the given (row, block) pairs."""
    vocab = y.shape[1]
    cols = blocks[:, None] * BLOCK + torch.arange(BLOCK)  # [pairs, BLOCK]
    inside = cols < vocab
    cols = cols.clamp(max=vocab - 1)
    hit = (y[rows[:, None], cols] >= t_b[rows][:, None]) & inside
    pair, offset = hit.nonzero(as_tuple=True)
    return rows[pair], cols[pair, offset]
