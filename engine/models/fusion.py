"""Weights fused at load for fewer, larger kernels (issue 51): q/k/v in one matrix, gate
and up in one, a MoE layer's experts stacked for one grouped GEMM. The checkpoint's own
parameters stay what they are (names, shapes, state_dict, sharding, the tests' reference
loops read them), but each becomes a parameter whose storage is a slice of the fused
tensor, so fusing costs no memory and an in-place edit of a parameter is an edit of the
fused tensor. A conversion
that replaces parameters (`.to`, `load_state_dict(assign=True)`) is followed by fusing
again (DLLM)."""
from __future__ import annotations

from typing import Sequence, Tuple

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


def fuse(groups: Sequence[Sequence[Tuple[nn.Module, str]]]) -> torch.Tensor:
    """One tensor holding the parameters `groups` name ((module, attribute) pairs): each
    group's concatenated along dim 0, the groups stacked (one group: no stack dimension);
    every parameter is replaced by one whose storage is its slice."""
    params = [[getattr(m, n) for m, n in g] for g in groups]
    cat = [torch.cat([p.detach() for p in g]) for g in params]
    fused = torch.stack(cat) if len(groups) > 1 else cat[0]
    for i, g in enumerate(groups):
        row = fused.select(0, i) if len(groups) > 1 else fused
        o = 0
        for (m, n), p in zip(g, params[i]):
            setattr(m, n, nn.Parameter(row.narrow(0, o, p.shape[0]), requires_grad=p.requires_grad))
            o += p.shape[0]
    return fused
