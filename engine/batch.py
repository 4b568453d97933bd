"""The mixed-state batch that lives between denoising steps, and its re-layout when
requests join, leave or start a new block.

Rows are left-padded to the bounding-box width W and position ids count from the
row's first real token. A row's current block ends `tail` columns before W: it is the
row's last L columns under the block canvas (tail 0), and is followed by the row's
still-masked later blocks under the full canvas. A row whose decoding rule keeps several
blocks in flight (D2F, engine.d2f) has `nact` of them, its last nact L columns (block
canvas only). The step decodes the batch's window, the last NB L columns before each
row's tail (NB = the largest nact), as B x NB units of L positions, of which each row's
last nact are its blocks. A re-layout rebuilds only the token ids and the bookkeeping;
the rows' K/V stay where they are (engine.slots)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from .decoding import RowParams
from .modes import CacheMode
from .models import KVCache
from .layout import Layout
from .sequence import Request, RowShape
from .transfer import to_device


@dataclass
class Batch:
    """Row i lives in K/V slot i (engine.slots). The per-row bookkeeping is on the host,
    so the loop decides without reading the device; `ids`, `mask`, the cache and the
    derived column tensors are on the device."""

    rows: List[Request]
    ids: torch.Tensor  # [B, W] (device)
    lens: torch.Tensor  # [B] row length: prompt + committed + current block (+ masked suffix)
    tail: torch.Tensor  # [B] columns after the current block (the full canvas's masked suffix)
    prompt_len: torch.Tensor  # [B]
    cached: torch.Tensor  # [B] leading real tokens whose K/V in `cache` are final
    step: torch.Tensor  # [B] denoising steps spent on the current block
    busy_steps: torch.Tensor  # [B] steps of the current block in which the row still had masks
    prompt_fwd: torch.Tensor  # [B] prompt tokens forwarded so far (accounting)
    frozen: torch.Tensor  # [B] finished rows a static batch keeps computing
    masked: torch.Tensor  # [B, L] which of the current block's positions still hold the mask
    mask: "AttentionMask"  # what each column's keys are visible to (device)
    row_params: RowParams  # per-row decoding parameters, built once per layout
    block_length: int
    cache: Optional[KVCache] = None  # the box view of the engine's KV slots
    nact: Optional[torch.Tensor] = None  # [B] blocks in flight (None: one each)
    block_cols: Optional[torch.Tensor] = None  # [B, NB L] the window's columns (device; None: uploaded here)

    def __post_init__(self):
        dev, L = self.ids.device, self.block_length
        if self.nact is None:
            self.nact = torch.ones(len(self.rows), dtype=torch.long)
        self.n_window = max(1, int(self.nact.max()))  # NB
        self.groups: Dict[Any, List[int]] = {}  # decoding rule -> its rows (engine.rules)
        for i, r in enumerate(self.rows):
            self.groups.setdefault(r.rule, []).append(i)
        # the step's logits processors over this layout (engine.processors.Processing): the rows
        # each asks for, found once (most batches have none, and the step then does nothing for them)
        self.processing: Any = None
        self.stepwise = any(rule.stepwise for rule in self.groups)  # rows commit at any step: advance by steps
        # a rule reads the step's proposals at decoded positions too (LLaDA2.1's editing): propose them all
        self.full_x0 = any(rule.reads_all_proposals for rule in self.groups)
        self.live = None  # (rule, rows not frozen): Engine._live, found again once a row froze
        self.runs_cache: Dict[Any, Any] = {}  # engine.runner: a forward's attention runs per row group, per layout
        n = self.n_window * L
        self.window_start = self.width - self.tail - n  # [B] first column of the window (host)
        if self.block_cols is None:
            self.block_cols = (self.window_start[:, None] + torch.arange(n)[None]).to(dev)  # [B, NB L] device
        # which window positions are a block of the row (host, and device for the step's masks)
        self.valid = torch.arange(n)[None] >= ((self.n_window - self.nact) * L)[:, None]
        self.valid_dev = to_device([self.valid], dev)[0] if self.n_window > 1 else None  # no host wait
        self.unit_params = self.row_params
        if self.n_window > 1:
            self.unit_params = self.row_params.take(torch.arange(len(self.rows)).repeat_interleave(self.n_window))

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    @property
    def start(self) -> torch.Tensor:
        return self.width - self.lens

    @property
    def block_start(self) -> torch.Tensor:
        """[B] first column of each row's current block (a D2F row: of its first block in flight)."""
        return self.width - self.tail - self.nact * self.block_length


@dataclass
class AttentionMask:
    """What a row's keys are visible to, kept as two [B, W] tensors (device) per batch
    layout; a forward builds the [B, 1, T, W] mask of its own query columns from them
    (`rows`), never the whole [B, 1, W, W] (O(B W^2) per layout, mostly for rows no
    forward queries). Pad keys are never attended. Block-causal models: the prompt
    attends to the prompt, block j to the prompt, earlier blocks and itself."""

    valid: torch.Tensor  # [B, W] bool: a real (not left-pad) column
    seg: Optional[torch.Tensor]  # [B, W] long: the column's attention segment; None: bidirectional

    @classmethod
    def build(cls, lens: torch.Tensor, prompt_len: torch.Tensor, width: int, block_length: int,
              block_causal: bool, absolute: bool = False,
              context: Optional[torch.Tensor] = None) -> "AttentionMask":
        """`absolute` (BlockLayout.ABSOLUTE): blocks at multiples of the block length from
        position 0, the prompt's among them. `context` [B] (Family.causal_context): each
        row's current block's first position; the columns before it attend causally (a
        segment each), the block's columns are one segment (bidirectional among
        themselves, seeing the whole prefix)."""
        col = torch.arange(width, device=lens.device)[None]
        valid = col >= (width - lens)[:, None]
        if context is not None:
            pos = (col - (width - lens)[:, None]).clamp(min=0)
            return cls(valid, torch.minimum(pos, context[:, None]))
        if not block_causal:
            return cls(valid, None)
        pos = (col - (width - lens)[:, None]).clamp(min=0)
        seg = pos // block_length if absolute else torch.where(
            pos < prompt_len[:, None], 0, (pos - prompt_len[:, None]) // block_length + 1)
        return cls(valid, seg)

    def rows(self, cols: Optional[torch.Tensor] = None, pick: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[B', 1, T, W] bool for query columns `cols` [B', T] (None: every column) of the
        rows `pick` (None: every row); [B', 1, 1, W] when every query sees the same keys."""
        valid, seg = (self.valid, self.seg) if pick is None else (
            self.valid[pick], None if self.seg is None else self.seg[pick])
        if seg is None:
            return valid[:, None, None, :]
        q = seg if cols is None else seg.gather(1, cols)
        return (valid[:, None, :] & (seg[:, None, :] <= q[:, :, None]))[:, None]


def attention_mask(lens: torch.Tensor, prompt_len: torch.Tensor, width: int, block_length: int,
                   block_causal: bool, absolute: bool = False) -> torch.Tensor:
    """The whole [B, 1, W|1, W] mask (AttentionMask.build, every query column)."""
    return AttentionMask.build(lens, prompt_len, width, block_length, block_causal, absolute).rows()


def start_next_block(lens: torch.Tensor, tail: torch.Tensor, step: torch.Tensor, busy: torch.Tensor,
                     cached: torch.Tensor, grew: torch.Tensor, shape: RowShape, mode: CacheMode):
    """(lens, tail, step, busy_steps, cached) once the rows in `grew` committed a block
    and start the next: under the block canvas L more columns, under the full canvas
    the next L of the suffix; a fresh step count; `refresh` and `dual` recompute the
    row (nothing cached), `persistent` keeps its cache (engine.modes)."""
    if mode.recomputes_at_block_start():
        cached = torch.where(grew, 0, cached)
    grow = grew.long() * shape.block_length
    lens, tail = (lens, tail - grow) if shape.full_canvas else (lens + grow, tail)
    return lens, tail, torch.where(grew, 0, step), torch.where(grew, 0, busy), cached


@dataclass
class Rows:
    """The host bookkeeping of a re-layout's rows ([B] each; `masked` [B, L]): kept rows'
    from the old batch (`src` their old index, -1 for a new row; `grew`: kept rows starting
    their next block), new rows' from their requests."""

    src: torch.Tensor
    kept: torch.Tensor
    grew: Optional[torch.Tensor]  # None: no row is kept
    lens: torch.Tensor
    tail: torch.Tensor
    cached: torch.Tensor
    step: torch.Tensor
    busy: torch.Tensor
    fwd: torch.Tensor
    frozen: torch.Tensor
    masked: torch.Tensor

    @property
    def any_kept(self) -> bool:
        return self.grew is not None


def keep_rows(old: Optional[Batch], rows: List[Request], grown: set, shape: RowShape, mode: CacheMode) -> Rows:
    """Step 1 of relayout: kept rows' bookkeeping gathered from `old` (frozen if they were),
    the rows in `grown` starting their next block (start_next_block), new rows' fresh."""
    L, B = shape.block_length, len(rows)
    old_index: Dict[Request, int] = {r: i for i, r in enumerate(old.rows)} if old is not None else {}
    src = torch.tensor([old_index.get(r, -1) for r in rows])
    kept = src >= 0
    lens = torch.tensor([shape.width(r) for r in rows])
    tail = torch.tensor([shape.tail(r) for r in rows])
    # separate tensors: the loop updates step, cached and prompt_fwd in place
    cached, step, busy = (torch.zeros(B, dtype=torch.long) for _ in range(3))
    fwd = torch.tensor([r.prompt_forwarded for r in rows])
    frozen = torch.zeros(B, dtype=torch.bool)
    masked = torch.ones(B, L, dtype=torch.bool)  # a new or grown row's block is all masks
    if not bool(kept.any()):
        return Rows(src, kept, None, lens, tail, cached, step, busy, fwd, frozen, masked)
    s = src.clamp(min=0)
    grew = torch.tensor([r in grown for r in rows]) & kept
    k_lens, k_tail, k_step, k_busy, k_cached = start_next_block(
        old.lens[s], old.tail[s], old.step[s], old.busy_steps[s], old.cached[s], grew, shape, mode)
    lens, tail = torch.where(kept, k_lens, lens), torch.where(kept, k_tail, tail)
    step, busy = torch.where(kept, k_step, 0), torch.where(kept, k_busy, 0)
    if mode.caches:
        cached = torch.where(kept, k_cached, 0)
    fwd = torch.where(kept, old.prompt_fwd[s], fwd)
    frozen = kept & old.frozen[s]
    masked = torch.where((kept & ~grew)[:, None], old.masked[s][:, -L:], masked) & ~frozen[:, None]
    return Rows(src, kept, grew, lens, tail, cached, step, busy, fwd, frozen, masked)


def window_masks(rows: List[Request], masked: torch.Tensor, frozen: torch.Tensor, nact: torch.Tensor,
                 shape: RowShape, mask_id: int) -> torch.Tensor:
    """Step 2: which positions of each row's window [B, NB L] hold the mask: its current
    block's (`masked` [B, L]), and a stepwise rule's blocks in flight (D2F: masks may be in
    any of them), none in a frozen row."""
    L = shape.block_length
    window = torch.zeros(len(rows), max(1, int(nact.max())) * L, dtype=torch.bool)
    window[:, -L:] = masked
    for i, r in enumerate(rows):
        if r.rule.stepwise:
            n = window.shape[1] - r.n_active * L
            tokens = r.rule.in_flight(r, shape, mask_id)
            window[i, n:] = (torch.tensor(tokens, dtype=torch.long) == mask_id) & ~frozen[i]
    return window


def fresh_tokens(rows: List[Request], kept: torch.Tensor, width: int, shape: RowShape, mask_id: int,
                 pad_id: int) -> torch.Tensor:
    """Step 3a: the new rows' tokens [B, W] (host), right-aligned; pads elsewhere."""
    fresh = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i in torch.nonzero(~kept).flatten().tolist():
        r = rows[i]
        fresh[i, width - shape.width(r):] = torch.tensor(r.prompt + r.generated + r.rule.in_flight(r, shape, mask_id))
    return fresh


def token_matrix(old: Optional[Batch], book: Rows, fresh: torch.Tensor, up: List[torch.Tensor],
                 layout: Layout) -> torch.Tensor:
    """Step 3b: the batch's token ids [B, W] (device) from the uploaded parts `up`: new
    rows' fresh tokens, kept rows' old columns shifted to the new box (old column c lands
    at c + new start - old start), a grown row's new block L fresh masks (the full canvas
    holds them already)."""
    kept_d, *moves = up
    ids = torch.where(kept_d.bool()[:, None], layout.pad_id, fresh)
    if book.any_kept:
        s_d, src_col, keep_cols, grew_d = moves
        ids = torch.where(keep_cols.bool(), old.ids[s_d].gather(1, src_col), ids)
        if not layout.full_canvas:
            L, W = layout.block_length, ids.shape[1]
            ids[:, W - L:] = torch.where(grew_d.bool()[:, None], layout.mask_id, ids[:, W - L:])
    return ids


def scrub_frozen(ids: torch.Tensor, blk: torch.Tensor, frozen_d: torch.Tensor, mask_id: int, pad_id: int) -> None:
    """Step 4: a frozen row's window holds its last committed tokens: its masks become pads
    (nothing to denoise), in place."""
    cur = ids.gather(1, blk)
    ids.scatter_(1, blk, torch.where(frozen_d.bool()[:, None] & (cur == mask_id), pad_id, cur))


def row_params(old: Optional[Batch], rows: List[Request], same_rows: bool, layout: Layout, device) -> RowParams:
    """Step 5: the rows' decoding parameters (the old batch's when its rows are the same)."""
    if same_rows:
        return old.row_params
    family, L = layout.family, layout.block_length
    return RowParams.build(
        [r.params for r in rows], [r.noise_seed for r in rows], device, first_position_default=family.first_position,
        threshold=family.threshold, confidence=family.confidence, floor_one=[r.rule.floor_one for r in rows],
        caps=[r.rule.step_cap(r, L, layout.steps) for r in rows])


def relayout(old: Optional[Batch], rows: List[Request], grown: set, *, layout: Layout, device) -> Batch:
    """The batch for `rows` (in slot order): kept rows are gathered from `old` (shifted
    to the new box, frozen if they were), rows in `grown` committed a block and start
    the next one, new rows are built from their tokens. `refresh` and `dual` recompute
    a row at every block start; `persistent` only ever computes the tokens it has not
    cached. Its steps: keep_rows, window_masks, fresh_tokens and token_matrix (after one
    pinned, non-blocking upload of every host value the device needs), scrub_frozen,
    row_params, and the attention mask."""
    shape, mask_id, pad_id, L = layout.shape, layout.mask_id, layout.pad_id, layout.block_length
    book = keep_rows(old, rows, grown, shape, layout.config.mode)
    nact = torch.tensor([r.n_active for r in rows])
    masked = window_masks(rows, book.masked, book.frozen, nact, shape, mask_id)
    lens, tail, kept = book.lens, book.tail, book.kept
    W = int(lens.max())
    n = masked.shape[1]  # the window: a frozen D2F row may have masks in every block it had in flight
    same_rows = old is not None and rows == old.rows  # Request compares by identity
    prompt_len = old.prompt_len if same_rows else torch.tensor([r.prompt_len for r in rows])
    fresh = fresh_tokens(rows, kept, W, shape, mask_id, pad_id)
    parts = [lens, prompt_len, (W - tail - n)[:, None] + torch.arange(n)[None], fresh, kept.long(),
             book.frozen.long()]
    if book.any_kept:
        col, s = torch.arange(W)[None], book.src.clamp(min=0)
        start, old_start = W - lens, old.width - old.lens[s]
        src_col = (col - start[:, None] + old_start[:, None]).clamp(0, old.width - 1)
        parts += [s, src_col, (kept[:, None] & (col >= start[:, None])).long(), book.grew.long()]
    causal_context = layout.family.causal_context
    if causal_context:  # each row's current block's first position (its position, not its column)
        parts.append(lens - tail - nact * L)
    lens_d, plen_d, blk, fresh_d, kept_d, frozen_d, *moves = to_device(parts, device)
    context = moves.pop() if causal_context else None
    ids = token_matrix(old, book, fresh_d, [kept_d, *moves], layout)
    if bool(book.frozen.any()):
        scrub_frozen(ids, blk, frozen_d, mask_id, pad_id)
    return Batch(rows=list(rows), ids=ids, lens=lens, tail=tail, prompt_len=prompt_len, cached=book.cached,
                 step=book.step, busy_steps=book.busy, prompt_fwd=book.fwd, frozen=book.frozen, masked=masked,
                 mask=AttentionMask.build(lens_d, plen_d, W, L, layout.model.block_causal, layout.absolute,
                                          context),
                 row_params=row_params(old, rows, same_rows, layout, device), block_length=L, nact=nact,
                 block_cols=blk)
