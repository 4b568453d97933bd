"""The mixed-state batch that lives between denoising steps, and its re-layout when
requests join, leave or start a new block.

Rows are left-padded to the bounding-box width W and position ids count from the
row's first real token. A row's current block ends `tail` columns before W: it is the
row's last L columns under the block canvas (tail 0), and is followed by the row's
still-masked later blocks under the full canvas. A row's K/V stay valid across
re-layouts: kept rows are moved with one gather over the batch and position
dimensions, never recomputed."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from .decoding import RowParams
from .models import KVCache, ModelConfig
from .sequence import Request


@dataclass
class Batch:
    rows: List[Request]
    ids: torch.Tensor  # [B, W]
    lens: torch.Tensor  # [B] row length: prompt + committed + current block (+ masked suffix)
    tail: torch.Tensor  # [B] columns after the current block (the full canvas's masked suffix)
    prompt_len: torch.Tensor  # [B]
    cached: torch.Tensor  # [B] leading real tokens whose K/V in `cache` are final
    step: torch.Tensor  # [B] denoising steps spent on the current block
    busy_steps: torch.Tensor  # [B] steps of the current block in which the row still had masks
    prompt_fwd: torch.Tensor  # [B] prompt tokens forwarded so far (accounting)
    frozen: torch.Tensor  # [B] finished rows a static batch keeps computing
    cache: Optional[KVCache]
    mask: torch.Tensor  # attention mask [B, 1, W|1, W]
    row_params: RowParams  # per-row decoding parameters, built once per layout
    block_length: int
    kv_copied: int = 0  # K/V bytes the last re-layout or in-box growth copied (EngineStats)

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    @property
    def start(self) -> torch.Tensor:
        return self.width - self.lens

    @property
    def block_start(self) -> torch.Tensor:
        """[B] first column of each row's current block."""
        return self.width - self.tail - self.block_length

    def block_cols(self) -> torch.Tensor:
        """[B, L] the columns of each row's current block."""
        return self.block_start[:, None] + torch.arange(self.block_length, device=self.ids.device)[None]

    def positions(self) -> torch.Tensor:
        return (torch.arange(self.width, device=self.ids.device)[None] - self.start[:, None]).clamp(min=0)


def attention_mask(lens: torch.Tensor, prompt_len: torch.Tensor, width: int, block_length: int,
                   block_causal: bool) -> torch.Tensor:
    """Pad keys are never attended. Block-causal models: the prompt attends to the
    prompt, block j to the prompt, earlier blocks and itself."""
    col = torch.arange(width, device=lens.device)[None]
    valid = col >= (width - lens)[:, None]
    if not block_causal:
        return valid[:, None, None, :]
    pos = (col - (width - lens)[:, None]).clamp(min=0)
    seg = torch.where(pos < prompt_len[:, None], 0, (pos - prompt_len[:, None]) // block_length + 1)
    return (valid[:, None, :] & (seg[:, None, :] <= seg[:, :, None]))[:, None]


def start_next_block(lens: torch.Tensor, tail: torch.Tensor, step: torch.Tensor, busy: torch.Tensor,
                     cached: torch.Tensor, grew: torch.Tensor, block_length: int, cache_mode: str,
                     full_canvas: bool):
    """(lens, tail, step, busy_steps, cached) once the rows in `grew` committed a block
    and start the next: under the block canvas L more columns, under the full canvas
    the next L of the suffix; a fresh step count; `refresh` and `dual` recompute the
    row (nothing cached), `persistent` keeps its cache."""
    if cache_mode != "persistent":
        cached = torch.where(grew, 0, cached)
    grow = grew.long() * block_length
    lens, tail = (lens, tail - grow) if full_canvas else (lens + grow, tail)
    return lens, tail, torch.where(grew, 0, step), torch.where(grew, 0, busy), cached


def grow_in_place(old: Batch, grown: set, *, cache_mode: str, mask_token_id: int, block_causal: bool,
                  full_canvas: bool) -> bool:
    """The common step-advance case, done without copying the batch: the same rows in
    the same order, some of them starting their next block, and the box keeps its width.
    Under the block canvas a grown row shifts left by L inside its own row (its K/V too
    with `persistent`; `refresh` recomputes its prefix anyway); under the full canvas
    nothing moves. False when the case does not apply."""
    L, W = old.block_length, old.width
    grew = torch.tensor([r in grown for r in old.rows], device=old.ids.device)
    if bool(old.frozen.any()) or (not full_canvas and int((old.lens + grew.long() * L).max()) != W):
        return False
    old.kv_copied = 0
    if not full_canvas:
        g = torch.nonzero(grew).flatten()
        old.ids[g, : W - L] = old.ids[g, L:]
        old.ids[g, W - L:] = mask_token_id
        if old.cache is not None and cache_mode == "persistent":
            for t in old.cache.k + old.cache.v:
                t[g, :, : W - L] = t[g, :, L:]
            old.kv_copied = old.cache.nbytes() * len(g) * (W - L) // (old.ids.shape[0] * W)
    # new tensors, not in-place writes: `cached` may have been set under inference_mode
    old.lens, old.tail, old.step, old.busy_steps, old.cached = start_next_block(
        old.lens, old.tail, old.step, old.busy_steps, old.cached, grew, L, cache_mode, full_canvas)
    old.mask = attention_mask(old.lens, old.prompt_len, W, L, block_causal)
    return True


def relayout(old: Optional[Batch], rows: List[Request], grown: set, *, mcfg: ModelConfig, block_length: int,
             cache_mode: str, full_canvas: bool, first_position: bool, dtype: torch.dtype, device) -> Batch:
    """The batch for `rows`: kept rows are gathered from `old` (shifted to the new box,
    with their K/V, and frozen if they were), rows in `grown` committed a block and
    start the next one, new rows are built from their tokens. `refresh` and `dual`
    recompute a row at every block start; `persistent` only ever computes the tokens
    it has not cached."""
    L, dev = block_length, device
    old_index: Dict[Request, int] = {r: i for i, r in enumerate(old.rows)} if old is not None else {}
    B = len(rows)
    src = torch.tensor([old_index.get(r, -1) for r in rows], device=dev)
    kept = src >= 0
    lens = torch.tensor([r.width for r in rows], device=dev)
    tail = torch.tensor([r.tail for r in rows], device=dev)
    # separate tensors: the engine updates step and busy_steps in place
    cached, step, busy, fwd = (torch.zeros(B, dtype=torch.long, device=dev) for _ in range(4))
    frozen = torch.zeros(B, dtype=torch.bool, device=dev)
    any_kept = bool(kept.any())
    if any_kept:
        s = src.clamp(min=0)
        old_lens = old.lens[s]
        grew = torch.tensor([r in grown for r in rows], device=dev) & kept
        k_lens, k_tail, k_step, k_busy, k_cached = start_next_block(
            old_lens, old.tail[s], old.step[s], old.busy_steps[s], old.cached[s], grew, L, cache_mode, full_canvas)
        lens, tail = torch.where(kept, k_lens, lens), torch.where(kept, k_tail, tail)
        step, busy = torch.where(kept, k_step, 0), torch.where(kept, k_busy, 0)
        if cache_mode != "none":
            cached = torch.where(kept, k_cached, 0)
        fwd = torch.where(kept, old.prompt_fwd[s], 0)
        frozen = kept & old.frozen[s]
    W = int(lens.max())
    col = torch.arange(W, device=dev)[None]
    start = W - lens
    ids = torch.full((B, W), mcfg.pad_token_id, dtype=torch.long, device=dev)
    src_col = None
    if any_kept:
        # old column c of a kept row lands at c + (new start) - (old start)
        src_col = (col - start[:, None] + (old.width - old_lens)[:, None]).clamp(0, old.width - 1)
        moved = old.ids[s].gather(1, src_col)
        ids = torch.where(kept[:, None] & (col >= start[:, None]), moved, ids)
        if not full_canvas:  # a grown row's new block: L fresh masks (the full canvas holds them already)
            ids[:, W - L:] = torch.where(grew[:, None], mcfg.mask_token_id, ids[:, W - L:])
    for i in torch.nonzero(~kept).flatten().tolist():
        r = rows[i]
        ids[i, W - r.width:] = torch.tensor(r.prompt + r.generated + [mcfg.mask_token_id] * (L + r.tail), device=dev)
        fwd[i] = r.prompt_forwarded
    blk = (W - tail - L)[:, None] + torch.arange(L, device=dev)[None]
    if bool(frozen.any()):  # a frozen row's block holds its last committed tokens: nothing to denoise
        cur = ids.gather(1, blk)
        ids.scatter_(1, blk, torch.where(frozen[:, None] & (cur == mcfg.mask_token_id), mcfg.pad_token_id, cur))
    cache, copied = None, 0
    if cache_mode != "none" and src_col is not None and bool((cached > 0).any()):
        # One indexed read per tensor builds the new box. Columns of rows without
        # cache hold some old row's finite K/V: overwritten before use or masked out.
        bi, hi = src.clamp(min=0)[:, None, None], torch.arange(mcfg.n_kv_heads, device=dev)[None, :, None]
        ci = src_col[:, None, :]
        cache = KVCache([k[bi, hi, ci] for k in old.cache.k], [v[bi, hi, ci] for v in old.cache.v])
        copied = cache.nbytes()
    elif cache_mode != "none":
        cache = KVCache.empty(mcfg, B, W, dtype, dev)
    prompt_len = torch.tensor([r.prompt_len for r in rows], device=dev)
    return Batch(rows=list(rows), ids=ids, lens=lens, tail=tail, prompt_len=prompt_len, cached=cached, step=step,
                 busy_steps=busy, prompt_fwd=fwd, frozen=frozen, cache=cache,
                 mask=attention_mask(lens, prompt_len, W, L, mcfg.block_causal),
                 row_params=RowParams.build([r.params for r in rows], [r.noise_seed for r in rows], dev,
                                            first_position_default=first_position),
                 block_length=L, kv_copied=copied)
