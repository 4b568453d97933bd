"""Fast-dLLM v2's sub-blocks as a decoding rule (written from the published
v2/generation_functions.py `batch_sample`): a block of L positions is decoded in
sub-blocks of `sub_block_length` left to right, each step choosing only among the masks of
the leftmost sub-block that still holds one (the model still sees the whole block). The
step's policy is the row's (Fast-dLLM v2's family: ThresholdRule.GREATER_AT_LEAST_TOP1);
the block is committed once it holds no mask, as any block."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional

from .layout import Layout
from .reads import MASKED_SAMPLING, SUB_BLOCK_SAMPLING
from .rules import BlockRule
from .step_view import StepView

if TYPE_CHECKING:  # torch-free at import: the preflight reads `applies` and `unsupported`
    import torch


class SubBlockRule(BlockRule):
    name = "sub_blocks"
    reads = MASKED_SAMPLING | SUB_BLOCK_SAMPLING

    def applies(self, params: Any) -> bool:
        return params.sub_block_length is not None

    def unsupported(self, req: Any, layout: Layout) -> Optional[str]:
        L, s = layout.shape.block_length, req.params.sub_block_length
        if L % s:
            return f"sub_block_length={s} must divide block_length={L}"
        return None

    def candidates(self, view: StepView, rows: List[int], is_mask: torch.Tensor) -> torch.Tensor:
        """The masks of each row's leftmost sub-block that holds one."""
        if not rows:
            return is_mask
        import torch

        from .transfer import indices

        NB = view.n_window  # is_mask has NB units per row (D2F rows in the batch): a row's block is its last
        idx = indices([i * NB + NB - 1 for i in rows], is_mask.device)
        L = is_mask.shape[1]
        sub = indices([view.rows[i].params.sub_block_length for i in rows], is_mask.device)
        part = torch.arange(L, device=is_mask.device)[None] // sub[:, None]  # [n, L] sub-block of each position
        m = is_mask[idx]
        first = torch.where(m, part, L).min(1).values  # the leftmost sub-block with a mask
        out = is_mask.clone()
        out[idx] = m & (part == first[:, None])
        return out


SUB_BLOCKS = SubBlockRule()
