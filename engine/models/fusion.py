"""Weights fused at load for fewer, larger kernels (issue 51): q/k/v in one matrix, gate
and up in one, a MoE layer's experts stacked for one grouped GEMM. The checkpoint's own
parameters stay what they are (names, shapes, state_dict, sharding, the tests' reference
loops read them), but their storage becomes slices of the fused tensor, so fusing costs no
memory and an in-place edit of a parameter is an edit of the fused tensor. A conversion
that replaces parameters (`.to`, `load_state_dict(assign=True)`) is followed by fusing
again (DLLM)."""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch import nn


class Fusing(nn.Module):
    """A module whose forward reads fused weights (`fuse_`): fused when built, and again
    whenever its parameters are replaced (`_apply`: .to, .double, to_empty)."""

    def fuse_(self) -> None:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.fuse_()
        return out


def fuse(groups: Sequence[Sequence[nn.Parameter]]) -> torch.Tensor:
    """One tensor holding `groups`: each group's tensors concatenated along dim 0, the
    groups stacked (one group: no stack dimension); every parameter's storage becomes its
    slice. A parameter already a view of such a tensor is left as it is."""
    parts = [[p.data for p in g] for g in groups]
    base = parts[0][0]._base
    if base is not None and all(t._base is base for g in parts for t in g) and _laid_out(base, parts):
        return base
    cat = [torch.cat(g) for g in parts]
    fused = torch.stack(cat) if len(groups) > 1 else cat[0]
    for i, g in enumerate(groups):
        row = fused[i] if len(groups) > 1 else fused
        o = 0
        for p in g:
            n = p.shape[0]
            p.data = row[o:o + n]
            o += n
    return fused


def _laid_out(base: torch.Tensor, parts: List[List[torch.Tensor]]) -> bool:
    """Whether `parts` are exactly the slices `fuse` made of `base`, in order."""
    stacked = len(parts) > 1
    if stacked and base.shape[0] != len(parts):
        return False
    o = base.storage_offset()
    for g in parts:
        for t in g:
            if t.storage_offset() != o or not t.is_contiguous():
                return False
            o += t.numel()
    return o == base.storage_offset() + base.numel()
