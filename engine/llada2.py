"""LLaDA2's decoding in the engine's mixed batch (written from the published generate()
of LLaDA2.0-mini's and LLaDA2.1-mini's modeling_llada2_moe.py).

Blocks sit at absolute positions: multiples of the block length L from position 0. A
request's `prompt` is its whole prompt blocks and its `lead` the prompt's tail, which
opens the first decoded block (the published loop starts at block prompt_length // L
and never unmasks a prompt position); the attention mask is block-causal over those
absolute blocks, the prompt included (engine.batch.attention_mask `absolute`), so the
K/V of every block before the current one are final and the persistent cache is exact.

The threshold rule (engine.decoding.select, RowParams.llada2): the masked positions whose
confidence is strictly greater than `threshold`, or, when fewer than the schedule's k of
this step pass, the k most confident (LLaDA2.1's generate() uses k = 1: steps_per_block
= block_length gives that schedule).

LLaDA2.1's token editing (`SamplingParams.edit_threshold`): at every step of the block, a
decoded non-prompt token of the block is rewritten when the new proposal differs and its
probability is strictly greater than edit_threshold, together with the step's mask
commits. Once the block has no mask, at most `max_post_steps` editing-only steps follow,
ending at the first one without an edit; the row keeps its slot (and its block) until
then, whatever its neighbours do."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from .sequence import Request


def split_prompt(req: Request, block_length: int) -> None:
    """Move the prompt's tail after its last whole block into `req.lead`."""
    r = len(req.prompt) % block_length
    if r:
        req.prompt, req.lead = req.prompt[:-r], req.prompt[-r:]


def unsupported(req: Request, llada2: bool) -> Optional[str]:
    """Why this engine's model cannot serve `req`'s LLaDA2 settings, or None."""
    if req.params.edit_threshold is not None and not llada2:
        return "edit_threshold (LLaDA2.1 token editing) needs a LLaDA2 checkpoint (model_type 'llada2_moe')"
    if llada2 and req.params.d2f:
        return "block_add_threshold (D2F decoding) is not implemented for LLaDA2's absolute block layout"
    return None


@dataclass
class EditState:
    """One row's current block under token editing."""

    post_steps: int = 0  # editing-only steps taken
    done: bool = False  # the block is final: no more edits until it is committed
    had_mask: bool = True  # the step being taken started with masks in the block
    tokens: Optional[List[int]] = None  # the block after the last step (host)


def editing_rows(b) -> List[int]:
    """Rows of batch `b` decoding with token editing (not frozen)."""
    frozen = b.frozen.tolist()
    return [i for i, r in enumerate(b.rows) if r.params.edit_threshold is not None and not frozen[i]]


def edits(b, rows: List[int], logits: torch.Tensor, x0: torch.Tensor, window: torch.Tensor,
          is_mask: torch.Tensor) -> torch.Tensor:
    """Boolean [B, L]: the decoded tokens this step rewrites (rows `rows` only). A row's
    state starts afresh at its block's first step; a finished block is left alone."""
    L = b.block_length
    out = torch.zeros_like(is_mask)
    live = []
    for i, st in zip(rows, b.step[rows].tolist()):
        r = b.rows[i]
        if st == 0 or r.edit is None:
            r.edit = EditState()
        if not r.edit.done:
            r.edit.had_mask = bool(b.masked[i, -L:].any())
            live.append(i)
    if not live:
        return out
    idx = torch.tensor(live, device=logits.device)
    p = torch.softmax(logits[idx].to(torch.float64), dim=-1).gather(-1, x0[idx][..., None]).squeeze(-1)
    lead = torch.tensor([0 if b.rows[i].generated else len(b.rows[i].lead) for i in live], device=logits.device)
    thr = torch.tensor([float(b.rows[i].params.edit_threshold) for i in live], dtype=torch.float64,
                       device=logits.device)
    editable = ~is_mask[idx] & (torch.arange(L, device=logits.device)[None] >= lead[:, None])
    out[idx] = editable & (p > thr[:, None]) & (x0[idx] != window[idx])
    return out


def after_step(b, rows: List[int], blocks: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
    """`done` with the editing rows' own rule: a block is final after the step that
    commits its last mask when max_post_steps is 0, else after an editing-only step
    without an edit or the max_post_steps-th one (so an editing row's steps are bounded:
    at most max(S, L) with masks, then max_post_steps). `blocks` [B, L]: the host tokens."""
    done = done.clone()
    for i in rows:
        r, st = b.rows[i], b.rows[i].edit
        tokens = blocks[i].tolist()
        if not st.done:
            masked = b.masked[i].any()
            if st.had_mask:
                st.done = not masked and r.params.max_post_steps == 0
            else:
                st.post_steps += 1
                b.busy_steps[i] += 1  # an editing-only step is a step of the request (num_steps)
                st.done = tokens == st.tokens or st.post_steps >= r.params.max_post_steps
            st.tokens = tokens
        done[i] = st.done
    return done
