"""The K/V store that outlives batches: per layer one K and one V buffer
[rows_cap, H_kv, cols_cap, D], of which a batch of B rows and width W sees the box
view [:B, :, cols_cap - W:].

Why: rebuilding the batch's K/V box whenever a row joins, leaves, or the box widens
copies every row's K/V and holds two boxes at once. Here batch row i lives in slot i
and every row ends at the buffer's last column (rows are left-padded to the box, and
the box is right-aligned to the buffer's end), so:

- a wider or narrower box is another view, nothing moves;
- a joining row takes a free slot and is computed in place (no copy);
- a leaving row's slot goes to a joining row, or else to the row in the highest slot
  (that one row's K/V is copied, so slots stay 0..B-1);
- a row that starts its next block under the block canvas shifts left by L inside its
  own slot; its K/V move only under the persistent cache (refresh and dual recompute
  the row at a block start), and only that row's;
- only when the box outgrows the view's shape do the buffers take a new one
  rows_cap x cols_cap <= SLACK x token_budget: the same storage, viewed with another
  row stride, the rows with cached K/V moved to their new offsets one buffer at a time
  (the storage itself is allocated once, and again only for a batch wider than the
  budget, which the static baseline allows).

Memory: rows_cap * cols_cap * kv_bytes_per_token <= SLACK * token_budget * kv_bytes_per_token
(the scheduler keeps B x W <= token_budget), plus, while rows are copied (a new shape, a
move, a shift), one layer's K or V of those rows. Catch-up sub-batches attend to their
rows' slots in place (one attention per run of consecutive slots). With prefix caching
(engine.prefix_cache) cached prompt blocks live at the storage's end, beyond the view: a new
view leaves them the budget the batch does not use (`reserve`) and moves them out of its
way (`before_view`)."""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .models import KVCache, ModelConfig
from .transfer import indices

# Columns the slots may hold beyond token_budget: a box near the budget that changes shape
# (B x W ~ budget, B falling, W rising) needs a new shape less often (15 -> 8 reshapes at
# B32 on bench/kv_bench.py's skewed run). engine.budget plans memory for it.
SLACK = 1.05


def place(old_rows: Sequence, rows: Sequence) -> Tuple[list, List[Tuple[int, int]]]:
    """`rows` in slot order and the (from, to) slot moves that keep slots 0..B-1 filled.
    A kept row stays in its slot unless that slot is >= B; joining rows fill the
    other free slots (highest first, so new rows sit together for catch-up)."""
    slot: Dict[object, int] = {r: i for i, r in enumerate(old_rows)}
    B = len(rows)
    out: list = [None] * B
    movers, new = [], []
    for r in rows:
        s = slot.get(r)
        if s is None:
            new.append(r)
        elif s < B:
            out[s] = r
        else:
            movers.append(r)
    holes = [i for i in range(B) if out[i] is None]
    moves = [(slot[r], h) for r, h in zip(movers, holes)]
    for r, h in zip(movers, holes):
        out[h] = r
    for r, h in zip(new, holes[len(movers):]):
        out[h] = r
    return out, moves


class KVSlots:
    """Per-layer K/V buffers that batches view; counts the bytes it copies and its peak.

    Each of the 2 x n_layers buffers is a view [rows_cap, H, cols_cap, D] of one flat
    storage of `cells` columns, allocated (zeroed) once: a new shape re-views the same
    storage and moves the kept rows to their new offsets, so nothing is allocated or
    zeroed again and every column holds finite values (zeros or some row's old K/V),
    as masked-out pad keys must (NaN * 0 poisons attention)."""

    def __init__(self, mcfg: ModelConfig, token_budget: int, dtype: torch.dtype, device,
                 max_rows: Optional[int] = None, slack: float = SLACK):
        self.mcfg, self.budget, self.dtype, self.device = mcfg, token_budget, dtype, device
        self.slack = slack  # columns held, as a multiple of token_budget (more with compile_decode: engine.buckets)
        self.max_rows = max_rows
        self.cell_bytes = mcfg.kv_bytes_per_token(dtype.itemsize)  # K and V of every layer, one column
        self.storage: List[torch.Tensor] = []  # K of every layer, then V
        self.cells = 0  # columns the storage holds
        self.k: List[torch.Tensor] = []
        self.v: List[torch.Tensor] = []
        self.rows_cap = self.cols_cap = 0
        self.peak_bytes = 0
        self.copied: Dict[str, int] = {"regrow": 0, "move": 0, "shift": 0}
        # engine.prefix_cache: cells a new view leaves at the storage's end for cached prompt
        # blocks (given the batch's area), and what moves them out of a new view's way
        self.reserve: Callable[[int], int] = lambda area: 0
        self.before_view: Optional[Callable[[int, int, bool], None]] = None
        self._static: Dict[Tuple[int, int], KVCache] = {}  # static_box's caches of the current shape

    def _view(self, rows: int, cols: int) -> None:
        H, D, n = self.mcfg.n_kv_heads, self.mcfg.head_dim, self.mcfg.n_layers
        views = [t[: rows * H * cols * D].view(rows, H, cols, D) for t in self.storage]
        self.k, self.v = views[:n], views[n:]
        self.rows_cap, self.cols_cap = rows, cols
        self._static = {}

    def fit(self, rows: int, width: int, keep: Sequence[int], keep_width: int) -> None:
        """Room for a `rows` x `width` box, keeping the last `keep_width` columns of the
        slots `keep` (rows whose cached K/V are worth keeping). The new shape spends
        SLACK x token_budget columns: on more rows, room in both dimensions (sqrt of
        the spare area each); on a wider box with no more rows, which is how the box
        moves while rows finish and wider ones join, exactly the rows and all the room
        to width. The storage grows (buffer by buffer, one layer's K or V of transient)
        only when a batch is wider than that, which the static baseline allows."""
        if rows <= self.rows_cap and width <= self.cols_cap:
            return
        area = rows * width
        full = max(int(self.slack * self.budget), area)
        room = max(full - self.reserve(area), area)
        if rows > self.rows_cap:  # more rows than slots: room in both dimensions
            R = max(rows, int(rows * math.sqrt(room / area)))
            if self.max_rows:
                R = max(rows, min(R, self.max_rows))
        else:  # a wider box, no more rows (rows leave while wider ones join): all the room to width
            R = rows
        C = max(width, room // R)
        H, D, n_buffers = self.mcfg.n_kv_heads, self.mcfg.head_dim, 2 * self.mcfg.n_layers
        keep_width = min(keep_width, self.cols_cap, C)
        idx = indices(list(keep), self.device) if keep and keep_width else None
        buffer_bytes = self.cell_bytes // n_buffers  # one column of one layer's K (or V)
        grow = R * C > self.cells
        cells = max(full, R * C) if grow else self.cells  # the storage holds `full`: later shapes re-view it
        if self.before_view is not None:
            self.before_view(self.rows_cap * self.cols_cap, R * C, grow)
        alive = self.cells * n_buffers * buffer_bytes
        old_cols, olds = self.cols_cap, self.k + self.v or [None] * n_buffers
        self.k, self.v = [], []  # so that a replaced buffer is freed as soon as it is copied
        for i in range(n_buffers):
            kept = olds[i][idx, :, old_cols - keep_width:] if idx is not None else None  # a copy (indexed read)
            olds[i] = None
            transient = kept.numel() * kept.element_size() if kept is not None else 0
            if grow:  # allocate this buffer anew: the old one and its kept rows are alive meanwhile
                new = torch.zeros(cells * H * D, dtype=self.dtype, device=self.device)
                transient += cells * buffer_bytes
                if i < len(self.storage):
                    self.storage[i] = new
                else:
                    self.storage.append(new)
            self.peak_bytes = max(self.peak_bytes, alive + transient)
            if grow:
                alive += (cells - self.cells) * buffer_bytes
            if kept is not None:
                self.storage[i][: R * H * C * D].view(R, H, C, D)[idx, :, C - keep_width:] = kept
        self.cells = cells
        self._view(R, C)
        self.copied["regrow"] += (len(keep) if idx is not None else 0) * keep_width * self.cell_bytes
        self.peak_bytes = max(self.peak_bytes, self.cells * self.cell_bytes)

    def move(self, moves: Sequence[Tuple[int, int]], width: int) -> None:
        """Copy slots' last `width` columns from -> to (one indexed copy per buffer)."""
        if not moves:
            return
        src, dst = indices([list(m) for m in moves], self.device).unbind(1)
        c0 = self.cols_cap - width
        for t in self.k + self.v:
            t[dst, :, c0:] = t[src, :, c0:]
        self.copied["move"] += len(moves) * width * self.cell_bytes

    def shift(self, slots: Sequence[int], width: int, by: int) -> None:
        """Move the last `width` columns of `slots` left by `by` columns (a row that
        starts its next block keeps its cached prefix)."""
        if not slots:
            return
        idx = indices(list(slots), self.device)
        C = self.cols_cap
        for t in self.k + self.v:
            t[idx, :, C - width - by: C - by] = t[idx, :, C - width:]  # the read is a copy: no overlap
        self.copied["shift"] += len(slots) * width * self.cell_bytes

    def box(self, rows: int, width: int) -> KVCache:
        """The batch's cache: views of the buffers, so forwards write into the slots."""
        c0 = self.cols_cap - width
        return KVCache([t[:rows, :, c0:] for t in self.k], [t[:rows, :, c0:] for t in self.v])

    def static_box(self, rows: int, width: int) -> KVCache:
        """`box`, for the compiled step (engine.buckets): its views marked as static inputs
        (torch._dynamo.mark_static_address), whose addresses stay as long as the slots' shape,
        so that the graph writes into them in place rather than treating them as fresh inputs
        (on CUDA, CUDA-graph trees capture only then: cudagraph_utils' mutated inputs). One
        cache per bucket and shape, made again only after a new shape."""
        if (rows, width) not in self._static:
            cache = self.box(rows, width)
            for t in cache.k + cache.v:
                torch._dynamo.mark_static_address(t)
            self._static[(rows, width)] = cache
        return self._static[(rows, width)]
