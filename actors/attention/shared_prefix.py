"""Shared-prefix ("cascade", Hydragen) decode attention: blocks that several decodes' block
tables start with are read once per step for all of them.

With prefix groups (`actors.prefix_sharing`) a group's prefix KV is computed once and its full
blocks sit at the head of every member's block table, so a plain decode kernel reads them
once per member and step. Here `prepare` finds, from the block tables alone, every run of
blocks that two or more decodes share at the same place (a trie over the tables: a nested
group's blocks are a run below its parent's, at every level; blocks shared by the block-hash
prefix cache count as well), and `forward` attends per layer:

- every shared run once for all its decodes, all of a layer's runs in one call of the C
  kernel's run mode (`actors/kernels/shared_runs.h`): a run's queries stacked per kv head
  (`[members * heads_per_kv, dim]` against the run's `[keys, dim]`: two small matrix products
  in register tiles, the exact softmax between them, each row's log-sum-exp returned);
- each decode's own keys after its deepest run (the rest of its prompt, its generated tokens,
  the new one: never shared, so never empty) by the C kernel, which returns its log-sum-exp;
- the pieces merged exactly: for two parts with log-sum-exps l1, l2 and outputs o1, o2,
  `out = (e^(l1-l) o1 + e^(l2-l) o2)` with `l = log(e^l1 + e^l2)`, in float32, a level at a
  time (runs whose decodes are disjoint, e.g. the groups of one nesting depth, in one merge).

Only full blocks before the decode's new token are shared (a group's partial last prefix block
is each member's own copy), so the new token's K/V, written this step, is always in the
decode's own part. The result is the same softmax over the same keys, summed in another
order: equal to the plain kernel's to float32 rounding (tests/actors/test_shared_prefix.py).

A softcapped layer (Gemma 2) caps the run's scores as the kernel caps its own, before the
log-sum-exp. A head_dim that is not a multiple of the run mode's tile width (16) runs the
plain kernel over whole tables (no model we serve has one). A sliding-window
layer whose window is shorter than some decode's keys runs the plain kernel over whole tables
(a run's keys leave each member's window at a different place); shorter contexts share.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from actors.attention.base import KVCaches, LayerAttention, StepBatch, device_tensor
from actors.attention.kernel import KernelDecodeBackend, KernelDecodes
from actors.kernels import RUN_WIDTH, PagedDecode, check_step
from packing.layout import padded_block_tables


@dataclass(frozen=True)
class SharedRun:
    """Blocks (the same in each of these decodes' tables, at the same place) read once for
    the decodes `decodes` (their indices among the step's decodes). A step-level structure
    of the attention backend, not a prompt group (that is packing.PrefixGroup)."""

    decodes: np.ndarray  # [m] int64, m >= 2
    num_keys: int


@dataclass(frozen=True)
class RunRows:
    """Where a step's runs put their query rows for a model's head count: the packed rows
    (run by run, each `[kv_heads, members * heads_per_kv]`) taken from the decodes' flat
    `[decodes * heads]` rows `source`, run r's rows from `row_start[r]`; per merge level,
    the packed rows (None: all) and their flat rows."""

    source: torch.Tensor  # [rows] int64
    row_start: torch.Tensor  # [num_runs + 1] int64
    levels: tuple[tuple[torch.Tensor | None, torch.Tensor], ...]


@dataclass(frozen=True)
class SharedPrefixDecodes(KernelDecodes):
    """`SharedPrefixDecodeBackend`'s metadata: the kernel's tables hold each decode's own
    blocks only (after its deepest shared run), `seq_lens` its own keys; `runs` parents
    first, their blocks `run_tables` (padded) and keys `run_keys`, `levels` the runs merged
    together (disjoint decodes); `whole` the plain kernel's, for sliding-window layers
    shorter than `longest`. `rows` holds the runs' `RunRows` per head count, made by the
    step's first layer."""

    runs: tuple[SharedRun, ...]
    run_tables: torch.Tensor  # [num_runs, max_blocks] int64
    run_keys: torch.Tensor  # [num_runs] int64
    levels: tuple[tuple[int, ...], ...]
    whole: KernelDecodes
    longest: int  # the most keys of any decode
    rows: dict[int, RunRows] = field(default_factory=dict, compare=False)


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
    `min_keys` (`EngineConfig.shared_prefix_min_keys`): below, the extra work and merge cost
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
        run_tables = np.zeros((len(found), max(end - first for _, first, end in found)), np.int64)
        for r, (rows, first, end) in enumerate(found):
            run_tables[r, : end - first] = tables[rows[0], first:end]
        return SharedPrefixDecodes(
            int(batch.cu_seqlens_q[0]),
            own_tables,
            own_lens,
            tuple(
                SharedRun(rows.astype(np.int64), (end - first) * size) for rows, first, end in found
            ),
            device_tensor(run_tables, self.device),
            device_tensor(np.array([(end - first) * size for _, first, end in found]), self.device),
            merge_levels([rows for rows, _, _ in found]),
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
        in one call of the kernel's run mode, merged into its members' rows."""
        if not isinstance(meta, SharedPrefixDecodes):
            super().forward(meta, layer, query, key, value, params, out)
            return
        k_cache, v_cache = self.kv_caches[layer]
        _, _, kv_heads, dim = k_cache.shape
        if (params.window is not None and meta.longest > params.window) or dim % RUN_WIDTH:
            super().forward(meta.whole, layer, query, key, value, params, out)
            return
        n = len(meta.seq_lens)
        rows = slice(meta.first_row, meta.first_row + n)
        q = query[0, :, rows].transpose(0, 1).contiguous()  # [n, heads, dim]
        heads = q.shape[1]
        own = out[rows]  # [n, heads, dim], a view: merged in place
        lse = q.new_empty(n, heads, dtype=torch.float32)  # float32 in bf16 too (the kernel's)
        self.kernel.run(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            params.scale,
            own,
            lse,
            softcap=params.softcap,
        )
        if heads not in meta.rows:
            meta.rows[heads] = run_rows(meta, heads, kv_heads, self.device)
        layout = meta.rows[heads]
        q_runs = q.view(n * heads, dim).index_select(0, layout.source)
        o_runs = torch.empty(len(q_runs), dim, dtype=torch.float32)
        lse_runs = torch.empty(len(q_runs), dtype=torch.float32)
        self.kernel.runs(
            q_runs,
            k_cache,
            v_cache,
            meta.run_tables,
            meta.run_keys,
            layout.row_start,
            params.scale,
            o_runs,
            lse_runs,
            softcap=params.softcap,
        )
        # The merges in float32 (as flash-attention's and vLLM's merges run), rounded to the
        # model's dtype once at the end: in bfloat16 each run's merge would round it again.
        acc = own if own.dtype == torch.float32 else own.float()
        acc_rows, lse_rows = acc.view(n * heads, dim), lse.view(n * heads)
        for packed, flat in layout.levels:
            o_more = o_runs if packed is None else o_runs.index_select(0, packed)
            lse_more = lse_runs if packed is None else lse_runs.index_select(0, packed)
            o_own, lse_own = acc_rows.index_select(0, flat), lse_rows.index_select(0, flat)
            _merge(o_own, lse_own, o_more, lse_more)
            acc_rows.index_copy_(0, flat, o_own)
            lse_rows.index_copy_(0, flat, lse_own)
        if acc is not own:
            own.copy_(acc)


def merge_levels(members: list[np.ndarray]) -> tuple[tuple[int, ...], ...]:
    """The runs (by their decodes `members`) in levels whose runs share no decode, each run
    in the first level it fits (nested runs of one group land in successive levels)."""
    levels: list[list[int]] = []
    taken: list[set[int]] = []
    for r, rows in enumerate(members):
        new = set(rows.tolist())
        for level, used in zip(levels, taken, strict=True):
            if not used & new:
                level.append(r)
                used |= new
                break
        else:
            levels.append([r])
            taken.append(new)
    return tuple(tuple(level) for level in levels)


def run_rows(meta: SharedPrefixDecodes, heads: int, kv_heads: int, device: torch.device) -> RunRows:
    """The runs' packed query rows for `heads` query heads over `kv_heads` (`RunRows`)."""
    per_kv = heads // kv_heads
    within = np.arange(heads).reshape(kv_heads, 1, per_kv)  # kv head g's heads, in order
    source = [(run.decodes.reshape(1, -1, 1) * heads + within).ravel() for run in meta.runs]
    start = np.concatenate([[0], np.cumsum([len(s) for s in source])])
    flat = np.concatenate(source)
    levels = []
    for level in meta.levels:
        packed = np.concatenate([np.arange(start[r], start[r + 1]) for r in level])
        everything = len(meta.levels) == 1 and len(packed) == len(flat)
        levels.append(
            (
                None if everything else device_tensor(packed, device),
                device_tensor(flat[packed], device),
            )
        )
    return RunRows(device_tensor(flat, device), device_tensor(start, device), tuple(levels))


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
