"""The MLPs of a layer: SwiGLU (a dense layer's, one expert, a shared expert) and the
routed experts' mixture. Routing is vectorised over tokens in float32 (float64 for a
float64 model); experts run grouped: the (token, expert) pairs are sorted by expert, each
expert does one matmul over its tokens, and the weighted outputs are scattered back with
one index_add. No Python loop over tokens."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .families.moe import MoESpec
from .fusion import Fusing, fuse
from .ops import compute_dtype


class MLP(Fusing):
    """SwiGLU: one expert, the shared expert, or a MoE model's dense layer (no biases)."""

    def __init__(self, d: int, f: int, bias: bool = False):
        super().__init__()
        self.gate = nn.Linear(d, f, bias=bias)
        self.up = nn.Linear(d, f, bias=bias)
        self.down = nn.Linear(f, d, bias=bias)
        self.fuse_()

    def fuse_(self) -> None:
        """gate and up as one matrix (engine.models.fusion)."""
        self.w13 = fuse([[(self.gate, "weight"), (self.up, "weight")]])
        self.b13 = fuse([[(self.gate, "bias"), (self.up, "bias")]]) if self.gate.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.w13, self.b13, self.down)


def swiglu(x: torch.Tensor, w13: torch.Tensor, b13: Optional[torch.Tensor], down: nn.Linear) -> torch.Tensor:
    """down(silu(gate x) * up x) with gate and up as one matrix `w13` [2f, d]: 4 kernels."""
    g, u = F.linear(x, w13, b13).chunk(2, -1)
    return down(F.silu(g) * u)


def route(scores_logits: torch.Tensor, spec: MoESpec, bias) -> Tuple[torch.Tensor, torch.Tensor]:
    """(experts [N, k], weights [N, k]) of router logits [N, E] (in the router's dtype)."""
    scores = torch.softmax(scores_logits, -1) if spec.score == "softmax" else torch.sigmoid(scores_logits)
    choice = scores if bias is None else scores + bias.to(scores.dtype)
    if spec.bias_in_weights:
        scores = choice
    if spec.n_group > 1:  # keep the topk_group groups whose best two choices score highest
        N, E = choice.shape
        groups = choice.view(N, spec.n_group, E // spec.n_group).topk(2, -1).values.sum(-1)
        keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.topk(spec.topk_group, -1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // spec.n_group, 1), float("-inf"))
    experts = choice.topk(spec.top_k, -1).indices
    weights = scores.gather(1, experts)
    if spec.renormalize and spec.top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return experts, weights * spec.scaling


def experts_forward(x: torch.Tensor, router: torch.Tensor, bias, experts: nn.ModuleList, spec: MoESpec,
                    owned: Optional[range] = None):
    """The routed experts' mixture for x [..., d]: route every token at once, sort the
    (token, expert) pairs by expert, one matmul per expert over its tokens, one index_add.
    `owned` (expert parallel, engine.models.sharding): only the pairs of these experts, the
    rank's partial mixture."""
    shape, flat = x.shape, x.reshape(-1, x.shape[-1])
    rd = compute_dtype(x.dtype)
    chosen, weights = route(F.linear(flat.to(rd), router.to(rd)), spec, bias)
    k = chosen.shape[1]
    order = chosen.reshape(-1).argsort(stable=True)
    if owned is not None:  # the pairs of this rank's experts, still sorted by expert
        e = chosen.reshape(-1)[order]
        order = order[(e >= owned.start) & (e < owned.stop)]
        if not len(order):
            return torch.zeros_like(x)
    tokens = order // k
    counts = torch.bincount(chosen.reshape(-1) if owned is None else chosen.reshape(-1)[order],
                            minlength=spec.num_experts).tolist()
    xs, outs, o = flat[tokens], [], 0
    for e, n in enumerate(counts):  # one matmul per expert that has tokens
        if n:
            outs.append(experts[e](xs[o:o + n]))
            o += n
    y = torch.cat(outs) * weights.reshape(-1)[order, None].to(x.dtype)
    return torch.zeros_like(flat).index_add_(0, tokens, y).view(shape)
