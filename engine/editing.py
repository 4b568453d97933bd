"""LLaDA2.1's token editing as a decoding rule (written from the published generate() of
LLaDA2.1-mini's modeling_llada2_moe.py), for families whose decoding traits allow it
(`Family.editing`).

At every step of the block, a decoded non-prompt token of the block is rewritten when the
new proposal differs and its probability is strictly greater than `edit_threshold`,
together with the step's mask commits (whose threshold rule takes at least one position
a step: LLaDA2.1's loop). An edit may write the mask token itself: that position is
masked again and decoded again, as in the published loop. Steps that start with no mask
are editing-only; the block ends after one of them that edits nothing, or once it has no
mask after `max_post_steps` of them; the row keeps its slot (and its block) until then,
whatever its neighbours do. The published loop has no other bound; the engine's, for a
model that keeps re-masking, is L x max(S, L) + max_post_steps steps (`step_cap`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional

from .layout import Layout
from .reads import EDITING_SAMPLING, MASKED_SAMPLING
from .rules import BlockRule
from .step_view import StepView, Verdict

if TYPE_CHECKING:
    import torch


@dataclass
class EditState:
    """One row's current block under token editing."""

    post_steps: int = 0  # steps that started with no mask (editing-only), never reset inside the block
    done: bool = False  # the block is final: no more edits until it is committed
    had_mask: bool = True  # the step being taken started with masks in the block
    tokens: Optional[List[int]] = None  # the block after the last step (host)


class EditingRule(BlockRule):
    name = "editing"
    reads = MASKED_SAMPLING | EDITING_SAMPLING
    floor_one = True
    reads_all_proposals = True  # its edits are proposals at decoded positions

    def applies(self, params: Any) -> bool:
        return params.edit_threshold is not None

    def unsupported(self, req: Any, layout: Layout) -> Optional[str]:
        if not layout.family.editing:
            return (f"edit_threshold (LLaDA2.1 token editing) is not part of {layout.family.name}'s decoding; "
                    "families with token editing: LLaDA2 (model_type 'llada2_moe')")
        return None

    def step_cap(self, req: Any, block_length: int, steps: int) -> int:
        """A bound the published loop does not have (see the module docstring)."""
        return block_length * max(steps, block_length) + req.params.max_post_steps

    def select(self, view: StepView, rows: List[int], sel: torch.Tensor) -> torch.Tensor:
        """The step's mask commits plus its edits: the decoded tokens it rewrites. A row's
        state starts afresh at its block's first step; a finished block is left alone."""
        logits, x0, window, is_mask = view.logits, view.x0, view.window, view.is_mask
        L = view.block_length
        live = []
        for i, st in zip(rows, view.step[rows].tolist()):
            r = view.rows[i]
            if st == 0 or r.state is None:
                r.state = EditState()
            if not r.state.done:
                r.state.had_mask = bool(view.masked[i, -L:].any())
                live.append(i)
        if not live:
            return sel
        import torch  # here: the module is torch-free at import (the preflight reads `unsupported`)

        from .transfer import indices

        idx = indices(live, logits.device)
        p = torch.softmax(logits[idx].to(torch.float64), dim=-1).gather(-1, x0[idx][..., None]).squeeze(-1)
        lead = indices([0 if view.rows[i].generated else len(view.rows[i].lead) for i in live], logits.device)
        thr = indices([float(view.rows[i].params.edit_threshold) for i in live], logits.device, torch.float64)
        editable = ~is_mask[idx] & (torch.arange(L, device=logits.device)[None] >= lead[:, None])
        edits = torch.zeros_like(is_mask)
        edits[idx] = editable & (p > thr[:, None]) & (x0[idx] != window[idx])
        return sel | edits

    def after_step(self, view: StepView, rows: List[int], blocks: torch.Tensor, done: torch.Tensor) -> Verdict:
        """Whether each editing row's block is final, as the published loop decides: after
        a step that started with no mask and edited nothing, or once the block holds no
        mask after max_post_steps steps that started with none (or at the step cap).
        `blocks` [B, L]: the host tokens. An editing-only step is a step of the request
        (num_steps): counted in the verdict's `busy`."""
        done, busy = done.clone(), view.busy_steps.new_zeros(done.shape)
        caps = view.params.host.cap  # this rule's step_cap
        for i in rows:
            r = view.rows[i]
            st, tokens = r.state, blocks[i].tolist()
            if not st.done:
                if not st.had_mask:
                    st.post_steps += 1
                    busy[i] = 1
                masked = bool(view.masked[i].any())
                st.done = (not st.had_mask and tokens == st.tokens) or (
                    not masked and st.post_steps >= r.params.max_post_steps) or int(view.step[i]) >= int(caps[i])
                st.tokens = tokens
            done[i] = st.done
        return Verdict(done, busy)


EDITING = EditingRule()
