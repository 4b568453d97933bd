"""The model runner: one forward over a batch (or a sub-batch of its rows), the cache
window arithmetic that says which columns it computes and stores, and the catch-up
planner that brings rows with a long uncached stretch up to date first. The window
arithmetic runs on the host from the batch's host bookkeeping; the device only
receives index tensors, so a forward never waits on it."""
from __future__ import annotations

import time
from typing import List, Optional, Tuple

import torch

from .batch import Batch
from .config import EngineConfig
from .models import DLLM
from .stats import EngineStats, ForwardFit

# What one more forward costs, in query cells, beyond the cells it computes (kernel
# launches, per-layer host work); it keeps catch-up from splitting into tiny groups.
FORWARD_OVERHEAD_CELLS = 256


def catch_up_groups(need: List[int], floor: int, after: Optional[List[int]] = None,
                    overhead: float = FORWARD_OVERHEAD_CELLS) -> List[List[int]]:
    """Rows to bring up to date before the batch's forward, grouped by similar stretch.

    `need[i]` is how many columns row i must compute now (at least `floor`);
    `after[i]` (default `floor`) how many it still computes in the batch's forward once
    caught up (its block, and under the full canvas without dual cache its masked
    suffix). One forward over rows with different needs pads each to the largest, so
    rows with a long uncached stretch (just admitted, refreshing a prefix, or with a
    committed block to cache) are forwarded first in sub-batches of similar need.
    Picks the split with the fewest computed cells (dynamic programming over rows
    sorted by need, `overhead` cells per extra forward: the engine's online fit, or
    FORWARD_OVERHEAD_CELLS before it has one); [] when one forward is cheapest.
    Each group lists its rows in ascending order."""
    n = len(need)
    after = after if after is not None else [floor] * n
    order = sorted((i for i in range(n) if need[i] > after[i]), key=lambda i: -need[i])
    cand = set(order)
    base = max([floor] + [need[i] for i in range(n) if i not in cand])
    d = [need[i] for i in order] + [0]
    m = len(order)
    caught_after = [0] * (m + 1)  # widest `after` among order[:k]
    for k in range(1, m + 1):
        caught_after[k] = max(caught_after[k - 1], after[order[k - 1]])
    # best[k]: fewest cells for rows order[:k] in sub-batches; cut[k]: where its last group starts
    best, cut = [0.0] + [float("inf")] * m, [0] * (m + 1)
    for k in range(1, m + 1):
        for j in range(k):  # last group = order[j:k], padded to d[j]
            c = best[j] + (k - j) * d[j] + overhead
            if c < best[k]:
                best[k], cut[k] = c, j
    # the rest join the batch forward, as wide as its widest row
    k = min(range(m + 1), key=lambda k: best[k] + n * max(base, d[k], caught_after[k]))
    groups = []
    while k > 0:
        groups.append(sorted(order[i] for i in range(cut[k], k)))
        k = cut[k]
    return groups[::-1]


def runs_of(rows: List[int]) -> List[Tuple[int, int]]:
    """Ascending `rows` as [start, stop) runs of consecutive values."""
    runs: List[Tuple[int, int]] = []
    for r in rows:
        if runs and r == runs[-1][1]:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs


class ModelRunner:
    def __init__(self, model: DLLM, cfg: EngineConfig, stats: EngineStats):
        self.model, self.cfg, self.mcfg, self.stats = model, cfg, model.config, stats
        self.device = model.device
        self.shift = int(self.mcfg.shift_logits)
        self.fit = ForwardFit()  # forward time = a + b * cells, from this engine's own forwards

    def overhead_cells(self) -> float:
        """What one more forward costs the planner: EngineConfig.forward_overhead_cells when
        set (plans are then a function of the requests alone), else the online fit."""
        fixed = self.cfg.forward_overhead_cells
        return float(fixed) if fixed is not None else self.fit.overhead_cells(FORWARD_OVERHEAD_CELLS)

    def windows(self, b: Batch):
        """Per row (host tensors), the query columns [q0, q1) a forward must compute now
        and [fresh, q1) those whose K/V it stores. The block's L columns always (and the
        column before it for Dream's shifted logits); without a cache the whole row;
        with one, what is not final yet: the whole row at a block start under
        refresh/dual, the new committed block under persistent, and the masked suffix
        under the full canvas unless the dual cache keeps it."""
        L, start, bs, mode = self.cfg.block_length, b.start, b.block_start, self.cfg.mode
        q1 = torch.full_like(start, b.width)
        if not mode.caches:
            return start, q1, start
        fresh = start + b.cached
        if mode.caches_suffix:
            q1 = torch.where(b.cached > 0, bs + L, q1)
        return torch.minimum(fresh, bs - self.shift), q1, fresh

    def catch_up(self, b: Batch) -> None:
        """Forward the rows with a long uncached stretch first, in sub-batches of similar
        stretch (catch_up_groups), so the batch's forward stays about one block wide."""
        mode = self.cfg.mode
        if not mode.caches:
            return
        q0, q1, _ = self.windows(b)
        L = self.cfg.block_length
        # once caught up, a row computes its block, and its suffix unless the dual cache holds it
        after = mode.later_step_columns(b.nact * L + self.shift, b.tail, None)
        overhead = self.overhead_cells()
        self.stats.forward_overhead_cells = overhead
        for group in catch_up_groups((q1 - q0).tolist(), L + self.shift, after.tolist(), overhead):
            self.forward(b, group)

    def forward(self, b: Batch, group: Optional[List[int]] = None) -> torch.Tensor:
        """Window logits [n, NB L, V] for the rows `group` (ascending; all rows when None):
        each row's current block, or the batch's window of NB blocks when D2F rows hold
        several in flight (positions outside a row's blocks are clamped into its query and
        ignored); read for Dream from the column before each position. With a cache only the
        columns whose K/V are not final are computed and stored (`windows`); the
        query's other columns are padding. Rows' windows that all end at the box's edge
        are one slice of columns; otherwise (dual cache mid-block) each row's columns
        are gathered. A group's rows attend to views of their K/V slots, one attention
        per run of consecutive slots: nothing is copied."""
        L, W, dev, shift = self.cfg.block_length, b.width, self.device, self.shift
        cache = b.cache
        pick = slice(None) if group is None else torch.tensor(group)
        rows = lambda t: t[pick]  # noqa: E731 - this forward's rows of a [B, ...] host tensor
        q0, q1, fresh = (rows(t) for t in self.windows(b))
        start, bs, plen = rows(b.start), rows(b.block_start), rows(b.prompt_len)
        T = int((q1 - q0).max())
        first = q1 - T  # [n] each row's first query column, right-aligned at q1
        contiguous = bool((q1 == W).all())
        qcols = first[:, None] + torch.arange(T)[None]
        qc = qcols.clamp(min=0)
        real = qcols >= q0[:, None]
        write = real & (qcols >= fresh[:, None])
        at = rows(b.window_start)[:, None] - shift - first[:, None] + torch.arange(b.n_window * L)[None]
        if b.n_window > 1:
            at = at.clamp(min=0)
        if shift and self.cfg.mode.caches:  # Fast-dLLM's Dream: a cached step reads the
            # block's first position (committed at the block's first step) from itself
            at[:, 0] += rows(b.row_params.first_position_host & (b.step > 0)).long()
        pos = (qc - start[:, None]).clamp(min=0)
        qc_d, real_d = qc.to(dev), real.to(dev)
        ids, mask, runs = b.ids, b.mask, None
        if group is not None:
            idx = pick.to(dev)
            ids, mask = ids[idx], mask[idx]
            runs = runs_of(group)
        tokens = torch.where(real_d, ids.gather(1, qc_d), self.mcfg.pad_token_id)
        qmask = mask if mask.shape[2] == 1 else mask.gather(2, qc_d[:, None, :, None].expand(-1, 1, -1, W))
        t0 = time.perf_counter()
        with torch.inference_mode():
            if cache is None:
                logits = self.model(tokens, pos.to(dev), qmask[..., W - T:], logits_at=at.to(dev))
            else:
                logits = self.model(tokens, pos.to(dev), qmask, cache, W - T,
                                    write=None if bool(write.all()) else write.to(dev), runs=runs,
                                    cols=None if contiguous else qc_d, logits_at=at.to(dev))
                b.cached[pick] = bs - start  # everything before the block is final
            if self.cfg.profile and dev.type == "cuda":  # exact forward_s, at the cost of a stall
                torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        cells, n_real = len(q0) * T, int(real.sum())
        if dev.type != "cuda" or self.cfg.profile:  # timed to completion: fit on it
            self.fit.add(cells, seconds)
        st = self.stats
        st.forward_s += seconds
        st.forwards += 1
        st.computed_cells += cells
        st.padded_cells += cells - n_real
        # prompt columns computed (with a cache: stored) by this forward
        lo = torch.maximum(first, torch.maximum(q0, fresh) if cache is not None else q0)
        fwd = (torch.minimum(q1, start + plen) - torch.maximum(lo, start)).clamp(min=0)
        b.prompt_fwd[pick] += fwd
        return logits
