"""The canvas engine's K/V: per layer one buffer (slots, kv heads, positions, head dim)
holding each active row's encoder K/V at its absolute positions (column p = position p),
right-padded, the rows compacted into slots 0..B-1 in batch order. So a decoder step's
cache is a view of the first B slots (no per-step copy of any row's K/V), and one mask
per layer type says which columns a query sees: positions below the row's length, and on
sliding layers only the last sliding_window - 1 of them (what transformers' own
DynamicSlidingWindowLayer keeps: the same keys, hence the same attention).

`Pass` is what transformers' encoder and decoder are handed as their `cache`: the
decoder reads `layers[i].keys/values` (and `is_compileable`), the encoder calls `update`,
which writes the new K/V into the rows' slots and returns the keys the new tokens attend.
In a fused pass (`canvas` > 0: the encoder's layers run the new tokens, right padded,
followed by every row's canvas; engine.canvas.engine `_fused`) `update` writes only the
new tokens' K/V and returns the buffer's view with the canvas's own K/V after it, as the
decoder's attention appends them (`with_canvas`: in columns past every row's tokens, put
back after the forward: the canvas is not committed)."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..transfer import to_device


class RowKV:
    """The K/V of the active rows, one buffer per layer, grown (never per step) when a
    row or a position does not fit; `lens[s]` tokens held by slot s."""

    def __init__(self, n_layers: int, device: torch.device):
        self.n_layers, self.device = n_layers, device
        self.keys: List[Optional[torch.Tensor]] = [None] * n_layers
        self.values: List[Optional[torch.Tensor]] = [None] * n_layers
        self.rows_cap = 0
        self.len_cap = 0
        self.regrows = 0

    def reserve(self, rows: int, length: int) -> None:
        """Room for `rows` slots of `length` positions (buffers grow by half again)."""
        if rows <= self.rows_cap and length <= self.len_cap:
            return
        r = max(rows, self.rows_cap + self.rows_cap // 2) if rows > self.rows_cap else self.rows_cap
        n = max(length, self.len_cap + self.len_cap // 2) if length > self.len_cap else self.len_cap
        n = -(-n // 16) * 16
        for i in range(self.n_layers):
            for bufs in (self.keys, self.values):
                old = bufs[i]
                if old is None:
                    continue
                new = old.new_zeros((r, old.shape[1], n, old.shape[3]))
                new[:old.shape[0], :, :old.shape[2]] = old
                bufs[i] = new
        self.rows_cap, self.len_cap = r, n
        self.regrows += 1

    def _alloc(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.keys[i] is None:
            self.keys[i] = k.new_zeros((self.rows_cap, k.shape[1], self.len_cap, k.shape[3]))
            self.values[i] = v.new_zeros((self.rows_cap, v.shape[1], self.len_cap, v.shape[3]))

    def write(self, i: int, slots: torch.Tensor, cols: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              pick: Optional[torch.Tensor] = None) -> None:
        """k, v (J, H, t, D) of slots (J,) at columns cols (J, t); `pick`: the tokens written,
        as indices into the J t (the others are padding of a right-padded pass); indices
        the host knows, not a mask (whose count the host would wait for)."""
        self._alloc(i, k, v)
        rows = slots.view(-1, 1).expand_as(cols)
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # (J, t, H, D)
        if pick is not None:
            flat = lambda x: x.reshape(-1, *x.shape[2:]).index_select(0, pick)  # noqa: E731
            rows, cols, kt, vt = flat(rows), flat(cols), flat(kt), flat(vt)
        self.keys[i].transpose(1, 2).index_put_((rows, cols), kt)
        self.values[i].transpose(1, 2).index_put_((rows, cols), vt)

    def move(self, dst: Sequence[int], src: Sequence[int]) -> None:
        """Slots `src` into slots `dst` (compaction when rows leave)."""
        if not dst:
            return
        d, s = to_device([torch.tensor(list(dst)), torch.tensor(list(src))], self.device)
        for bufs in (self.keys, self.values):
            for i, b in enumerate(bufs):
                if b is not None:
                    b[d] = b[s]

    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for bufs in (self.keys, self.values) for b in bufs if b is not None)


class Pass:
    """One forward's cache over rows `slots` (a range start..stop when contiguous, else an
    index tensor): columns lo[kind]..hi of each layer, and for the encoder the columns the
    new tokens are written at (`cols`, and `pick`: RowKV.write's)."""

    is_compileable = False

    class _Layer:
        def __init__(self, keys: Optional[torch.Tensor], values: Optional[torch.Tensor]):
            self.keys, self.values = keys, values

    def __init__(self, kv: RowKV, layer_types: Sequence[str], slots, lo: dict, hi: int,
                 cols: Optional[torch.Tensor] = None, pick: Optional[torch.Tensor] = None, canvas: int = 0):
        self.kv, self.types, self.slots, self.lo, self.hi = kv, list(layer_types), slots, lo, hi
        self.cols, self.pick, self.canvas = cols, pick, canvas
        self._saved: List = []  # with_canvas's (columns, what they held)
        self.layers = [Pass._Layer(*self._view(i)) for i in range(kv.n_layers)] if cols is None else []

    def _view(self, i: int):
        k, v = self.kv.keys[i], self.kv.values[i]
        if k is None:
            return None, None
        lo = self.lo[self.types[i]]
        if isinstance(self.slots, slice):
            return k[self.slots, :, lo:self.hi], v[self.slots, :, lo:self.hi]
        return k[:, :, lo:self.hi].index_select(0, self.slots), v[:, :, lo:self.hi].index_select(0, self.slots)

    def with_canvas(self, i: int, keys: torch.Tensor, values: torch.Tensor):
        """The keys and values the canvas attends in layer i (a decoder step's, a fused
        pass's): the cached columns lo..hi followed by the canvas's `keys`/`values`
        (B, KV, L, D), as one view of the buffer. The canvas's are written in the columns
        hi..hi+L past every row's tokens (RowKV.reserve'd by the engine), so no layer copies
        the rows' cached K/V (transformers concatenates them); the engine puts back what
        those columns held (`restore`) after the forward: the canvas's K/V are never kept."""
        k, v = self.kv.keys[i], self.kv.values[i]
        s, lo, hi = self.slots, self.lo[self.types[i]], self.hi
        assert isinstance(s, slice), "the canvas's K/V go in place only over contiguous slots"
        end = hi + keys.shape[2]
        for buf, new in ((k, keys), (v, values)):
            scratch = buf[s, :, hi:end]
            self._saved.append((scratch, scratch.clone()))
            scratch.copy_(new)
        return k[s, :, lo:end], v[s, :, lo:end]

    def restore(self) -> None:
        """What `with_canvas` overwrote, back."""
        for scratch, old in self._saved:
            scratch.copy_(old)
        self._saved = []

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        """The encoder's write: the new K/V into the rows' slots, then the keys they attend
        (in a fused pass, followed by the canvas's K/V, not written)."""
        slots = self.slots
        idx = torch.arange(slots.start, slots.stop, device=keys.device) if isinstance(slots, slice) else slots
        t = self.cols.shape[1]
        self.kv.write(layer_idx, idx, self.cols, keys[:, :, :t], values[:, :, :t], self.pick)
        if not self.canvas:
            return self._view(layer_idx)
        return self.with_canvas(layer_idx, keys[:, :, t:], values[:, :, t:])


__all__ = ["Pass", "RowKV"]
