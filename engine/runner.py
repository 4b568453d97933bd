"""The model runner: one forward over a batch (or a sub-batch of its rows), the cache
window arithmetic that says which columns it computes and stores, and the catch-up
planner that brings rows with a long uncached stretch up to date first. The window
arithmetic runs on the host from the batch's host bookkeeping; the device only
receives index tensors, so a forward never waits on it."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .batch import Batch
from .buckets import Box, ShapeBuckets
from .config import EngineConfig
from .models import DLLM
from .stats import EngineStats, ForwardFit, ForwardTimer
from .transfer import indices, to_device

# What one more attention call costs, in keys of one row: a run of rows of similar key width
# shares a call rather than each row paying it (key_runs). On the CPU a call costs about as
# much as 16 keys of a block's queries, but 128 keeps a skewed batch at B=32 to ~1.5 calls a
# layer (a layer <= 22 launches; issue 51) for the same tokens per CPU-second (bench/README.md);
# on an accelerator a launch is worth far more keys (there FlexAttention block masks or
# varlen attention are the way to skip them: not built).
ATTENTION_OVERHEAD_KEYS = {"cpu": 128}
ATTENTION_OVERHEAD_KEYS_DEVICE = 2048

# What one more forward costs, in query cells, beyond the cells it computes (kernel
# launches, per-layer host work); it keeps catch-up from splitting into tiny groups.
FORWARD_OVERHEAD_CELLS = 256

# Graphs the compiled step may make before it gives up and runs eager (dynamo's own limit, 8,
# is per code object: every model of the process shares it).
COMPILE_RECOMPILE_LIMIT = 32


def catch_up_groups(need: List[int], floor: int, after: Optional[List[int]] = None,
                    overhead: float = FORWARD_OVERHEAD_CELLS, rejoin: bool = True) -> List[List[int]]:
    """Rows to bring up to date before the batch's forward, grouped by similar stretch.

    `need[i]` is how many columns row i must compute now (at least `floor`);
    `after[i]` (default `floor`) how many it still computes in the batch's forward once
    caught up (its block, and under the full canvas without dual cache its masked
    suffix). One forward over rows with different needs pads each to the largest, so
    rows with a long uncached stretch (just admitted, refreshing a prefix, or with a
    committed block to cache) are forwarded first in sub-batches of similar need.
    Picks the split with the fewest computed cells (dynamic programming over rows
    sorted by need, `overhead` cells per extra forward: EngineConfig.forward_overhead_cells,
    else the engine's online fit, or FORWARD_OVERHEAD_CELLS before it has one); [] when
    one forward is cheapest. `rejoin`: caught-up rows also run in the batch's forward
    (False: they take their step's logits from the catch-up, so the batch's forward is
    the other rows', one more forward's overhead when there are any).
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
    def batch_forward(k: int) -> float:  # the rest (and, rejoining, the caught-up rows): as wide as the widest
        if rejoin:
            return n * max(base, d[k], caught_after[k])
        return (n - k) * max(base, d[k]) + overhead if n > k else 0.0
    k = min(range(m + 1), key=lambda k: best[k] + batch_forward(k))
    groups = []
    while k > 0:
        groups.append(sorted(order[i] for i in range(cut[k], k)))
        k = cut[k]
    return groups[::-1]


def key_runs(rows: List[int], starts: List[int], width: int, overhead: int) -> List[Tuple[int, int, int]]:
    """The forward's rows (ascending slots; `starts[i]`: row i's first real column) as
    (slot start, slot stop, first key) runs: consecutive slots attended in one call to
    keys [first key, width), the smallest start among them. A row joins the current run
    when that attends fewer keys than a run of its own plus `overhead` keys (one call's
    cost); so left padding is skipped, not masked, but rows of similar width share a call."""
    runs: List[List[int]] = []
    for r, s in zip(rows, starts):
        if runs and r == runs[-1][1]:
            a, _, k = runs[-1]
            n = r - a
            k2 = min(k, s)
            if (n + 1) * (width - k2) <= n * (width - k) + (width - s) + overhead:
                runs[-1] = [a, r + 1, k2]
                continue
        runs.append([r, r + 1, s])
    return [tuple(x) for x in runs]


@dataclass
class ForwardPlan:
    """One forward, decided on the host: its rows, query columns, what it stores, the
    attention runs, and what it will count."""

    pick: Any  # slice(None) (every row) or the rows' indices
    group: Optional[List[int]]
    T: int  # query columns per row
    contiguous: bool  # every row's queries end at the box's edge: one slice of columns
    box: Optional[Box]  # the bucket it is padded to when it runs compiled (EngineConfig.compile_decode)
    qc: torch.Tensor  # [n, T] query columns (n, T: the box's rows and queries when compiled)
    real: torch.Tensor  # [n, T] which are real (not padding)
    write: Optional[torch.Tensor]  # [n, T] which to store (None: all)
    at: torch.Tensor  # [n, NB L] query columns whose logits are read
    pos: torch.Tensor  # [n, T] position ids
    runs: Optional[List[Tuple[int, int, int]]]  # (slot start, slot stop, first key) with a cache
    cells: int
    n_real: int
    pad_keys: int  # (query, left-pad key) pairs attended
    pad_keys_unskipped: int  # the same, had every row attended the whole box
    prompt_fwd: torch.Tensor  # [n] prompt columns computed
    cached_after: torch.Tensor  # [n] cached columns once it ran (the real rows)
    vc: Optional[torch.Tensor] = None  # [n, T] compiled: the query columns in the box's keys, all distinct
    uncompiled: bool = False  # a steady step compile_decode runs eager (its bucket does not fit, or it gave up)

    @property
    def compiled(self) -> bool:
        return self.box is not None


class ModelRunner:
    def __init__(self, model: DLLM, cfg: EngineConfig, stats: EngineStats):
        self.model, self.cfg, self.mcfg, self.stats = model, cfg, model.config, stats
        self.device = model.device
        self.shift = int(self.mcfg.shift_logits)
        self.fit = ForwardFit()  # forward time = a + b * cells, from this engine's own forwards
        self.timer = ForwardTimer(self.fit, self.device, exact=self.cfg.profile)
        self.attention_overhead = ATTENTION_OVERHEAD_KEYS.get(self.device.type, ATTENTION_OVERHEAD_KEYS_DEVICE)
        self._decode = None  # the compiled step (EngineConfig.compile_decode); False: given up
        self.compiles = cfg.compile_decode
        self.buckets = ShapeBuckets(cfg.block_length, self.shift, cfg.max_batch_size)
        self.backend = "inductor"  # torch.compile's backend (tests give one that records the graphs)
        self.slots = None  # the engine's K/V slots (engine.slots), which compiled steps view whole buckets of
        self._ahead = None  # (batch, key, plan, uploaded inputs) of the last whole-batch plan
        self.prepared_hits = 0  # whole-batch forwards that ran a plan made before them (a step before, or `prepare`)

    def decode_model(self):
        """The model compiled for the steady step's whole-batch forward, whose shapes are padded to
        buckets (engine.buckets). Compiled with dynamic shapes, as vLLM compiles once for every
        batch size: inductor compiles a graph or two (dynamo specialises a size of 1) where
        static shapes compiled one per bucket, and the CUDA graphs stay one per bucket, since
        CUDA-graph trees record one per distinct set of sizes. The K/V views it writes into are marked static
        (KVSlots.static_box), so on CUDA `reduce-overhead` captures each bucket's graph rather
        than skipping a graph that mutates inputs, and replays it with only the step's small
        inputs copied in (not yet measured on a GPU: bench/gpu/run.sh's blockserve+step+compile
        run does). Its logits are read before the next step."""
        if self._decode is None:
            inductor_cuda = self.device.type == "cuda" and self.backend == "inductor"
            self._decode = torch.compile(self.model, backend=self.backend, dynamic=True,
                                         mode="reduce-overhead" if inductor_cuda else None)
        return self._decode

    def room(self, rows: int, width: int) -> Tuple[int, int]:
        """The rows and width the K/V slots keep room for: a compiled step's bucket when it
        fits in the slots' planned area (KVSlots.slack x token_budget), else the box."""
        if not self.compiles:
            return rows, width
        box = self.buckets.box(rows, 1, width, cached=True)
        fits = box.rows * box.keys <= int(self.slots.slack * self.slots.budget)
        return (box.rows, box.keys) if fits else (rows, width)

    def bucket(self, rows: int, T: int, width: int) -> Optional[Box]:
        """The bucket a steady whole-batch step runs compiled in, or None (eager) when it does not
        fit in the K/V slots' current shape or compiling gave up."""
        if self._decode is False:
            return None
        box = self.buckets.box(rows, T, width, cached=self.slots is not None)
        if self.slots is not None and (box.rows > self.slots.rows_cap or box.keys > self.slots.cols_cap):
            return None
        return box

    def run_compiled(self, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
        """The compiled step's logits, or None once dynamo would give up on it (its recompile
        limit: then this runner runs eager from here on, counted in EngineStats.compile_fallbacks,
        rather than dynamo falling back per call unseen)."""
        if self._decode is False:
            return None
        try:
            with torch._dynamo.config.patch(recompile_limit=COMPILE_RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
                out = self.decode_model()(*args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            self._decode = False
            self.stats.compile_fallbacks += 1
            return None
        self.stats.compiled_forwards += 1
        return out

    def overhead_cells(self) -> float:
        """What one more forward costs the planner: EngineConfig.forward_overhead_cells when
        set (plans are then a function of the requests alone), else the online fit."""
        fixed = self.cfg.forward_overhead_cells
        if fixed is not None:
            return float(fixed)
        fitted = self.fit.overhead_cells(FORWARD_OVERHEAD_CELLS)
        tp = getattr(self.model, "tp", None)  # each rank times its own forwards: plan from rank 0's fit
        return fitted if tp is None else tp.agree(fitted)

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
        # the column before the block for shifted logits, where the row has one (under blocks
        # at absolute positions a short prompt is all in the first block: nothing before it),
        # and for a causal-context row's seed at its block's first step
        return torch.maximum(torch.minimum(fresh, bs - self.shift - self.seeds(b)), start), q1, fresh

    def seeds(self, b: Batch) -> torch.Tensor:
        """[B] (host) 1 where a row's step reads its block's first position from the column
        before the block (Family.causal_context with first_position, at the block's first
        step: the seed, the causal logit of the token before it), else 0."""
        if not self.mcfg.family.causal_context:
            return torch.zeros_like(b.step)
        return (b.row_params.first_position & (b.step == 0)).long()

    def step_logits(self, b: Batch) -> torch.Tensor:
        """Window logits [B, NB L, V] of every row for this step. Rows a catch-up forward
        brought up to date take theirs from it, as the reference's block-start forward over
        the whole row is also the block's first step (Fast-dLLM's dual cache); the other
        rows run in one forward. With compile_decode every row runs in that forward, so
        that it is the whole batch's, which runs compiled."""
        caught = self.catch_up(b, rejoin=self.compiles)
        if not caught or self.compiles:
            return self.forward(b)
        done = {i for g, _ in caught for i in g}
        rest = [i for i in range(len(b.rows)) if i not in done]
        if rest:
            caught.append((rest, self.forward(b, rest)))
        out = caught[0][1].new_empty(len(b.rows), *caught[0][1].shape[1:])
        for group, logits in caught:
            out[indices(group, out.device)] = logits
        return out

    def step_columns(self, b: Batch) -> torch.Tensor:
        """[B] the columns a row computes at a steady step (caught up): its block, and its
        suffix unless the dual cache holds it (a cached mode only)."""
        return self.cfg.mode.later_step_columns(b.nact * self.cfg.block_length + self.shift, b.tail, None)

    def catch_up(self, b: Batch, rejoin: bool) -> List[Tuple[List[int], torch.Tensor]]:
        """Forward the rows with a long uncached stretch first, in sub-batches of similar
        stretch (catch_up_groups), so the batch's forward stays about one block wide;
        returns each sub-batch's rows and window logits. `rejoin`: the caught-up rows run
        in the batch's forward too (catch_up_groups plans for it)."""
        mode = self.cfg.mode
        if not mode.caches:
            return []
        q0, q1, _ = self.windows(b)
        L = self.cfg.block_length
        after = self.step_columns(b)
        overhead = self.overhead_cells()
        self.stats.forward_overhead_cells = overhead
        if not bool(((q1 - q0) > after).any()):  # no row has more to compute than its step: no catch-up
            return []
        groups = catch_up_groups((q1 - q0).tolist(), L + self.shift, after.tolist(), overhead, rejoin)
        return [(group, self.forward(b, group, catch_up=True)) for group in groups]

    def forward(self, b: Batch, group: Optional[List[int]] = None, catch_up: bool = False) -> torch.Tensor:
        """Window logits [n, NB L, V] for the rows `group` (ascending; all rows when None):
        each row's current block, or the batch's window of NB blocks when D2F rows hold
        several in flight (positions outside a row's blocks are clamped into its query and
        ignored); read for Dream from the column before each position. Planned on the host
        (`plan`), run with one upload of its index tensors (`run`), counted (`account`)."""
        if group is None:
            p, inputs, reused = self.whole_batch_plan(b)
            self.prepared_hits += reused
        else:
            p = self.plan(b, group)
            inputs = None
        logits, seconds = self.run(b, p, inputs)
        self.account(b, p, seconds, catch_up)
        return logits

    def _plan_key(self, b: Batch) -> torch.Tensor:
        """What a whole-batch plan of layout `b` depends on besides the layout: each row's
        cached columns, and whether it is past its block's first step (Dream's read)."""
        return torch.stack([b.cached, (b.step > 0).long()])

    def whole_batch_plan(self, b: Batch) -> Tuple[ForwardPlan, List[torch.Tensor], bool]:
        """The plan of the forward over every row of `b` and its uploaded indices: the last
        one again while the layout and its key are the same (a block's later steps forward
        the same columns), else planned anew; and whether it was made before."""
        key = self._plan_key(b)
        last = self._ahead
        if last is not None and last[0] is b and torch.equal(last[1], key):
            return last[2], last[3], True
        p = self.plan(b)
        self._ahead = (b, key, p, self.upload(p))
        return p, self._ahead[3], False

    def prepare(self, b: Batch) -> None:
        """Plan the batch's next whole-batch forward and queue its index upload now, while the
        device still runs this step (called before the step's one device read): the next
        step uses them if the batch is the same one (no row joined, left or started a block)
        with the same key, else plans again. Work, not a guess: the plan is a function of
        host values the step's tokens do not change."""
        self.whole_batch_plan(b)

    def plan(self, b: Batch, group: Optional[List[int]] = None) -> ForwardPlan:
        """The forward's columns, from host values only. With a cache only the columns
        whose K/V are not final are computed and stored (`windows`); the query's other
        columns are padding. Rows' windows that all end at the box's edge are one slice of
        columns; otherwise (dual cache mid-block) each row's columns are gathered. Rows
        attend to views of their K/V slots, one attention per run of consecutive slots of
        similar key width (key_runs): a run's keys start at its first row's first real
        column, so left padding before it is not computed. A compiled forward (the whole
        batch's, with compile_decode) is padded to its bucket instead (engine.buckets):
        more query columns on the left, more keys on the left of the box (the slots'
        columns before it, masked out), more rows (slots after the batch's, attending to
        nothing), none of them stored."""
        L, W, shift = self.cfg.block_length, b.width, self.shift
        pick = slice(None) if group is None else torch.tensor(group)
        rows = lambda t: t[pick]  # noqa: E731 - this forward's rows of a [B, ...] host tensor
        q0, q1, fresh = (rows(t) for t in self.windows(b))
        start = rows(b.start)
        n = len(q0)
        T = int((q1 - q0).max())
        # compiled: the whole batch's steady step (every row caught up); a block start's whole rows, like
        # vLLM's prefills, run eager
        compiles = self.compiles and group is None and (
            not self.cfg.mode.caches or bool(((q1 - q0) <= self.step_columns(b)).all()))
        box = self.bucket(n, T, W) if compiles else None
        if box is not None:
            T = box.queries
        first = q1 - T  # [n] each row's first query column, right-aligned at q1
        qcols = first[:, None] + torch.arange(T)[None]
        qc = qcols.clamp(min=0)
        real = qcols >= q0[:, None]
        write = real & (qcols >= fresh[:, None])
        vc = None
        if box is not None:  # columns in the box's keys (box.keys - W more on the left); a query
            # column left of them wraps to the right of the row's window (not stored): all distinct
            vc = qcols + (box.keys - W)
            vc = torch.where(vc < 0, vc + T, vc)
        # clamped: a row's window position with no column before it (D2F's unused units, a block
        # opening a row under blocks at absolute positions) reads one it does not use
        at = (rows(b.window_start)[:, None] - shift - first[:, None] + torch.arange(b.n_window * L)[None]).clamp(min=0)
        if shift and self.cfg.mode.caches:  # Fast-dLLM's Dream: a cached step reads the
            # block's first position (committed at the block's first step) from itself
            at[:, 0] += rows(b.row_params.first_position & (b.step > 0)).long()
        at[:, 0] -= rows(self.seeds(b))  # the seed's logit: the column before the block
        cached = b.cache is not None
        contiguous = bool((q1 == W).all())
        slots = list(range(len(b.rows))) if group is None else group
        runs = None
        if cached and box is None:  # a function of the layout's row starts: planned once per layout and group
            key = None if group is None else tuple(group)
            if key not in b.runs_cache:
                got = key_runs(slots, start.tolist(), W, self.attention_overhead)
                ks = torch.cat([torch.full((hi - lo,), k) for lo, hi, k in got]) if got else None
                b.runs_cache[key] = (got, 0 if ks is None else int((start - ks).sum()))
            runs, pad_per_query = b.runs_cache[key]
        if box is not None:  # pad keys attended: the whole bucket's, every key of a padded row's
            pad_keys = T * (int(start.sum()) + n * (box.keys - W) + (box.rows - n) * box.keys)
        elif runs:  # pad keys attended: before each row's first real column, from its run's first key
            pad_keys = T * pad_per_query
        elif cached:
            pad_keys = T * int(start.sum())
        else:  # without a cache the keys are the query's own columns
            pad_keys = T * int((start - (W - T)).clamp(min=0).sum())
        # prompt columns computed (with a cache: stored) by this forward
        lo = torch.maximum(first, torch.maximum(q0, fresh) if cached else q0)
        plen = rows(b.prompt_len)
        pos = (qc - start[:, None]).clamp(min=0)
        if box is not None:  # padded rows: column 0 (read as pad), not stored, logits of position 0
            pad = lambda t: F.pad(t, (0, 0, 0, box.rows - n))  # noqa: E731
            qc, real, write, at, pos = pad(qc), pad(real), pad(write), pad(at), pad(pos)
            vc = torch.cat([vc, torch.arange(T).expand(box.rows - n, T)])
        return ForwardPlan(
            pick=pick, group=group, T=T, contiguous=contiguous, box=box, qc=qc, real=real,
            write=None if bool(write.all()) and box is None else write,  # compiled: always a tensor
            at=at, pos=pos, runs=runs, cells=len(qc) * T, n_real=int(real.sum()), pad_keys=pad_keys,
            pad_keys_unskipped=T * int(start.sum()),
            prompt_fwd=(torch.minimum(q1, start + plen) - torch.maximum(lo, start)).clamp(min=0),
            cached_after=rows(b.block_start) - start, vc=vc, uncompiled=compiles and box is None)

    def upload(self, p: ForwardPlan) -> List[torch.Tensor]:
        """The plan's index tensors on the device, in one copy (pinned and non-blocking on CUDA)."""
        parts = [p.qc, p.pos, p.at, p.real.long()] + ([] if p.write is None else [p.write.long()])
        if p.vc is not None:
            parts.append(p.vc)
        if p.group is not None:
            parts.append(p.pick[:, None])
        return to_device(parts, self.device)

    def run(self, b: Batch, p: ForwardPlan, inputs: Optional[List[torch.Tensor]] = None) -> Tuple[torch.Tensor, float]:
        """(logits, seconds): the index tensors go to the device (`upload`, unless `prepare`
        did), then the model runs: compiled on a bucket (eager on the same inputs once the
        compiled step gave up), else on the plan's rows as they are."""
        got = inputs if inputs is not None else self.upload(p)
        args, kw = (self.bucket_inputs if p.compiled else self.inputs)(b, p, got)
        timer = self.timer.start(p.cells)
        t0, c0 = time.perf_counter(), time.thread_time()
        with torch.inference_mode():
            logits = self.run_compiled(args, kw) if p.compiled else None
            if logits is None:
                logits = self.model(*args, **kw)
            if p.compiled:  # the real rows
                logits = logits[:len(b.rows)]
            if self.cfg.profile and self.device.type == "cuda":  # exact forward_s, at the cost of a stall
                torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        self.stats.forward_cpu_s += time.thread_time() - c0
        timer.stop(seconds)
        return logits, seconds

    def inputs(self, b: Batch, p: ForwardPlan, got: List[torch.Tensor]) -> Tuple[tuple, dict]:
        """The model's arguments for the plan's rows as they are (not padded to a bucket)."""
        W, T = b.width, p.T
        qc_d, pos_d, at_d, real_d = got[0], got[1], got[2], got[3].bool()
        ids, idx = b.ids, None
        if p.group is not None:
            idx = got[-1][:, 0]
            ids = ids[idx]
        tokens = torch.where(real_d, ids.gather(1, qc_d), self.mcfg.pad_token_id)
        qmask = b.mask.rows(qc_d, idx)
        if b.cache is None:
            return (tokens, pos_d, qmask[..., W - T:]), dict(logits_at=at_d)
        write_d = None if p.write is None else got[4].bool()
        return (tokens, pos_d, qmask, b.cache, W - T), dict(
            write=write_d, runs=p.runs, cols=None if p.contiguous else qc_d, logits_at=at_d)

    def bucket_inputs(self, b: Batch, p: ForwardPlan, got: List[torch.Tensor]) -> Tuple[tuple, dict]:
        """The compiled step's arguments, padded to its bucket (`plan`): the batch's token ids
        and mask with the box's extra rows (no key visible) and keys (masked out), and the
        K/V slots' static view of the whole bucket."""
        box, n, W = p.box, len(b.rows), b.width
        qc_d, pos_d, at_d, real_d = got[0], got[1], got[2], got[3].bool()
        write_d, vc_d = got[4].bool(), got[5]
        ids = F.pad(b.ids, (0, 0, 0, box.rows - n))
        tokens = torch.where(real_d, ids.gather(1, qc_d), self.mcfg.pad_token_id)
        qmask = F.pad(b.mask.rows(qc_d[:n]), (box.keys - W, 0, 0, 0, 0, 0, 0, box.rows - n),
                      value=False)
        if b.cache is None:
            return (tokens, pos_d, qmask), dict(logits_at=at_d)
        cache = self.slots.static_box(box.rows, box.keys)
        return (tokens, pos_d, qmask, cache, box.keys - box.queries), dict(write=write_d, cols=vc_d, logits_at=at_d)

    def account(self, b: Batch, p: ForwardPlan, seconds: float, catch_up: bool) -> None:
        """The batch's bookkeeping after the forward (what is cached, prompt columns
        forwarded) and the engine's counters."""
        if b.cache is not None:
            b.cached[p.pick] = p.cached_after  # everything before the block is final
        b.prompt_fwd[p.pick] += p.prompt_fwd
        st = self.stats
        st.forward_s += seconds
        st.forwards += 1
        st.computed_cells += p.cells
        st.padded_cells += p.cells - p.n_real
        st.pad_key_cells += p.pad_keys
        st.pad_key_cells_unskipped += p.pad_keys_unskipped
        if p.uncompiled:
            st.uncompiled_steps += 1
        if catch_up:  # a catch-up sub-batch
            for k, v in (("forwards", 1), ("cells", p.cells), ("padded_cells", p.cells - p.n_real), ("seconds", seconds)):
                st.catch_up[k] += v
