"""Shared-prefix ("cascade", Hydragen) decode attention: blocks that several decodes' block
tables start with are read once per step for all of them.

With prefix groups (`actors.prefix_sharing`) a group's prefix KV is computed once and its full
blocks sit at the head of every member's block table, so a plain decode kernel reads them
once per member and step. Here `prepare` finds, from the block tables alone, every run of
blocks that two or more decodes share at the same place (a trie over the tables: a nested
group's blocks are a run below its parent's, at every level; blocks shared by the block-hash
prefix cache count as well), and `forward` attends per layer:

- each shared run once for all its decodes: their queries stacked per kv head
  (`[members * heads_per_kv, dim]` against the run's `[keys, dim]`, one fused flash call with
  fp32 softmax pieces that returns the log-sum-exp of each row);
- each decode's own keys after its deepest run (the rest of its prompt, its generated tokens,
  the new one: never shared, so never empty) by the C kernel, which returns its log-sum-exp;
- the pieces merged exactly: for two parts with log-sum-exps l1, l2 and outputs o1, o2,
  `out = (e^(l1-l) o1 + e^(l2-l) o2)` with `l = log(e^l1 + e^l2)`, run by run.

Only full blocks before the decode's new token are shared (a group's partial last prefix block
is each member's own copy), so the new token's K/V, written this step, is always in the
decode's own part. The result is the same softmax over the same keys, summed in another
order: equal to the plain kernel's to float32 rounding (tests/actors/test_shared_prefix.py).

A softcapped layer (Gemma 2) caps the run's scores as the kernel caps its own, before the
log-sum-exp: the flash call has no softcap, so its runs are computed eagerly. A sliding-window
layer whose window is shorter than some decode's keys runs the plain kernel over whole tables
(a run's keys leave each member's window at a different place); shorter contexts share.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from actors.attention.base import KVCaches, LayerAttention, StepBatch, device_tensor
from actors.attention.kernel import KernelDecodeBackend, KernelDecodes
from actors.kernels import PagedDecode, check_step
from packing.layout import padded_block_tables

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (out, logsumexp)


@dataclass(frozen=True)
class SharedRun:
    """Blocks `blocks` (the same in each of these decodes' tables, at the same place) read
    once for the decodes `decodes` (their indices among the step's decodes). A step-level
    structure of the attention backend, not a prompt group (that is packing.PrefixGroup)."""

    decodes: torch.Tensor  # [m] int64, m >= 2
    decode_slice: slice | None  # the same decodes when they are consecutive
    blocks: torch.Tensor | slice  # [num_blocks] block ids, or a slice when consecutive ids
    num_keys: int


@dataclass(frozen=True)
class SharedPrefixDecodes(KernelDecodes):
    """`SharedPrefixDecodeBackend`'s metadata: the kernel's tables hold each decode's own
    blocks only (after its deepest shared run), `seq_lens` its own keys; `runs` parents
    first; `whole` the plain kernel's, for sliding-window layers shorter than `longest`."""

    runs: tuple[SharedRun, ...]
    whole: KernelDecodes
    longest: int  # the most keys of any decode


def shared_runs(
    tables: np.ndarray, num_full: np.ndarray
) -> tuple[list[tuple[np.ndarray, int, int]], np.ndarray]:
    """Runs of blocks that >= 2 rows of `tables` (`[n, max_blocks]`) share at the same place,
    among each row's first `num_full[i]` blocks: (rows, first block, end block) parents first,
    and each row's first block not in a run (0 when it shares nothing)."""
    runs: list[tuple[np.ndarray, int, int]] = []
    own_start = np.zeros(len(tables), dtype=np.int64)

    def split(rows: np.ndarray, depth: int) -> None:  # rows share blocks [0, depth)
        alive = rows[num_full[rows] > depth]
        if len(alive) < 2:
            return
        keys, inverse, counts = np.unique(
            tables[alive, depth], return_inverse=True, return_counts=True
        )
        for k in np.flatnonzero(counts >= 2):
            group = alive[inverse == k]
            limit = int(num_full[group].min())
            span = tables[group, depth:limit]
            same = (span == span[0]).all(axis=0)
            end = depth + (int(np.argmin(same)) if not same.all() else len(same))
            runs.append((group, depth, end))
            own_start[group] = end
            split(group, end)

    split(np.arange(len(tables)), 0)
    return runs, own_start


class SharedPrefixDecodeBackend(KernelDecodeBackend):
    """The C kernel's decodes, with the blocks that decodes share read once per run and step
    (see the module's docstring). A run is read apart only when its members x keys reach
    `min_keys` (`EngineConfig.shared_prefix_min_keys`): below, the extra call and merge cost
    more than the kernel's repeated reads, and its blocks stay in each member's own part. A
    step with no such run runs exactly as `KernelDecodeBackend`."""

    def __init__(self, kv_caches: KVCaches, kernel: PagedDecode, min_keys: int = 1) -> None:
        super().__init__(kv_caches, kernel)
        self.min_keys = min_keys

    def prepare(self, batch: StepBatch) -> KernelDecodes:
        """The shared runs of the step's decodes and each decode's own part."""
        assert batch.num_decodes == batch.num_reqs, "SharedPrefixDecodeBackend attends decodes"
        size = batch.block_size
        tables = padded_block_tables(batch.block_tables)
        # A block is shared only when full before the new token (num_cached // size of them).
        found, _ = shared_runs(tables, batch.num_cached.astype(np.int64) // size)
        found = [run for run in found if len(run[0]) * (run[2] - run[1]) * size >= self.min_keys]
        whole = super().prepare(batch)
        if not found:
            return whole
        # Each decode's own part: its blocks outside the runs it reads, in order (attention
        # does not depend on the keys' order; its partial last block stays last).
        taken = np.zeros(tables.shape, dtype=bool)
        for rows, first, end in found:
            taken[rows, first:end] = True
        order = np.argsort(taken, axis=1, kind="stable")  # own blocks first, in order
        own_tables = device_tensor(np.take_along_axis(tables, order, axis=1), self.device)
        seq_lens = batch.num_cached.astype(np.int64) + 1
        own_lens = device_tensor(seq_lens - taken.sum(axis=1) * size, self.device)
        check_step(own_tables, own_lens)
        runs = []
        for rows, first, end in found:
            ids = tables[rows[0], first:end]
            consecutive = bool((np.diff(ids) == 1).all())
            together = bool((np.diff(rows) == 1).all())
            runs.append(
                SharedRun(
                    decodes=device_tensor(rows.astype(np.int64), self.device),
                    decode_slice=slice(int(rows[0]), int(rows[-1]) + 1) if together else None,
                    blocks=slice(int(ids[0]), int(ids[-1]) + 1)
                    if consecutive
                    else device_tensor(ids, self.device),
                    num_keys=(end - first) * size,
                )
            )
        return SharedPrefixDecodes(
            int(batch.cu_seqlens_q[0]),
            own_tables,
            own_lens,
            tuple(runs),
            whole,
            int(seq_lens.max()),
        )

    def forward(
        self,
        meta: KernelDecodes,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        params: LayerAttention,
        out: torch.Tensor,
    ) -> None:
        """Each decode's own keys by the kernel (with log-sum-exps), then every shared run
        once, merged into its members' rows."""
        if not isinstance(meta, SharedPrefixDecodes):
            super().forward(meta, layer, query, key, value, params, out)
            return
        if params.window is not None and meta.longest > params.window:
            super().forward(meta.whole, layer, query, key, value, params, out)
            return
        k_cache, v_cache = self.kv_caches[layer]
        _, _, kv_heads, dim = k_cache.shape
        n = len(meta.seq_lens)
        rows = slice(meta.first_row, meta.first_row + n)
        q = query[0, :, rows].transpose(0, 1).contiguous()  # [n, heads, dim]
        heads = q.shape[1]
        scale = params.scale
        own = out[rows]  # [n, heads, dim], a view: merged in place
        lse = q.new_empty(n, heads, dtype=torch.float32)  # float32 in bf16 too (the kernel's)
        self.kernel.run(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            scale,
            own,
            lse,
            softcap=params.softcap,
        )
        # The merges in float32 (as flash-attention's and vLLM's merges run), rounded to the
        # model's dtype once at the end: in bfloat16 each run's merge would round it again.
        acc = own if own.dtype == torch.float32 else own.float()
        for run in meta.runs:
            m = len(run.decodes)
            sel = run.decode_slice
            q_run = q[sel] if sel is not None else q.index_select(0, run.decodes)
            # [m, heads, dim] -> [1, kv_heads, m * heads_per_kv, dim]: one matrix per kv head
            q_run = q_run.view(m, kv_heads, heads // kv_heads, dim).transpose(0, 1)
            q_run = q_run.reshape(1, kv_heads, -1, dim)
            if isinstance(run.blocks, slice):
                k_run, v_run = k_cache[run.blocks], v_cache[run.blocks]
            else:
                k_run = k_cache.index_select(0, run.blocks)
                v_run = v_cache.index_select(0, run.blocks)
            k_run = k_run.view(1, run.num_keys, kv_heads, dim).transpose(1, 2)
            v_run = v_run.view(1, run.num_keys, kv_heads, dim).transpose(1, 2)
            o_run, lse_run = _attend_run(q_run, k_run, v_run, params)
            o_run = o_run[0].reshape(kv_heads, m, -1, dim).transpose(0, 1).reshape(m, heads, dim)
            lse_run = lse_run[0].reshape(kv_heads, m, -1).transpose(0, 1).reshape(m, heads)
            if sel is not None:
                _merge(acc[sel], lse[sel], o_run, lse_run)
            else:
                o_own, lse_own = acc[run.decodes], lse[run.decodes]
                _merge(o_own, lse_own, o_run, lse_run)
                acc.index_copy_(0, run.decodes, o_own)
                lse.index_copy_(0, run.decodes, lse_own)
        if acc is not own:
            own.copy_(acc)


def _attend_run(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: LayerAttention
) -> tuple[torch.Tensor, torch.Tensor]:
    """A run's attention and log-sum-exps: `q` `[1, kv_heads, rows, dim]` against `k`, `v`
    `[1, kv_heads, keys, dim]`. The flash call, or eagerly in float32 when the layer
    softcaps its scores (the flash kernel cannot)."""
    if params.softcap is None:
        o, lse = _flash(q, k, v, scale=params.scale)[:2]
        return o, lse
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * params.scale
    scores = torch.tanh(scores / params.softcap) * params.softcap
    lse = torch.logsumexp(scores, dim=-1)  # [1, kv_heads, rows]
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float()), lse


def _merge(
    o: torch.Tensor, lse: torch.Tensor, o_more: torch.Tensor, lse_more: torch.Tensor
) -> None:
    """Attention over two disjoint key sets merged in place into (o, lse): `o` `[m, heads,
    dim]` and `lse` `[m, heads]` (both float32) become those of the union; `o_more` in any
    dtype (a bfloat16 run's flash output is widened here, not `o` narrowed)."""
    total = torch.logaddexp(lse, lse_more)
    o.mul_(torch.exp(lse - total).unsqueeze(-1))
    o.add_(o_more.float() * torch.exp(lse_more - total).unsqueeze(-1))
    lse.copy_(total)
