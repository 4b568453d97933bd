"""The MLPs of a layer: SwiGLU (a dense layer's, one expert, a shared expert) and the
routed experts' mixture. Routing is vectorised over tokens in float32 (float64 for a
float64 model); experts run as two grouped GEMMs over the experts stacked at load
(Layer.fuse_): the (token, expert) pairs sorted by expert, each expert's offset found on
device, the outputs put back in token order and mixed by one batched matmul. A fixed
number of kernels whatever the routing and no host wait (issue 51); float64 runs the
reference per-expert loop (grouped_mm has no float64 kernel). LLaDA2.2's block routing
(MoESpec.block_routed) admits expert_capacity experts per routing block of each row
before each token's top-k: DLLM.forward finds each token's block once per forward
(routing_blocks), and the admission is a fixed handful of kernels (admit)."""
from __future__ import annotations

from dataclasses import dataclass
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

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        return swiglu(x, self.w13, self.b13, self.down, residual)


def swiglu(x: torch.Tensor, w13: torch.Tensor, b13: Optional[torch.Tensor], down: nn.Linear,
           residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[residual +] down(silu(gate x) * up x), gate and up as one matrix `w13` [2f, d]: 4 kernels."""
    g, u = F.linear(x, w13, b13).chunk(2, -1)
    return plus_linear(residual, F.silu(g) * u, down)


def plus_linear(h: Optional[torch.Tensor], x: torch.Tensor, lin: nn.Module) -> torch.Tensor:
    """h + lin(x), as one addmm (the same sum, one kernel) where lin is a plain Linear
    without a bias; else added after it (a row-parallel shard's partial is all-reduced
    before the residual joins it)."""
    if h is None:
        return lin(x)
    if type(lin) is nn.Linear and lin.bias is None:
        return torch.addmm(h.reshape(-1, h.shape[-1]), x.reshape(-1, x.shape[-1]), lin.weight.t()).view(h.shape)
    return h + lin(x)


@dataclass(frozen=True)
class RoutingBlocks:
    """Each token's routing block (block routing, MoESpec.block_routed): `ids` [N] in
    [0, count), one id per (row, block of block_size positions) of a forward; the last id
    gathers the padding, which must not join a real block's maximum."""

    ids: torch.Tensor
    count: int


def routing_blocks(pos: torch.Tensor, block_size: int) -> RoutingBlocks:
    """The routing blocks of a forward's tokens from their position ids [B, T]: a token's
    block is its position // block_size within its row (the prompt's too: blocks at
    absolute positions, as the published gate reshapes the whole sequence), never shared
    across rows. Left padding (blockray's runner gives it the position 0 of the row's first
    real column; any column whose position is not below the next one's) goes to the padding
    block. A row's real positions are contiguous (every blockray forward's are): they touch
    at most (T - 1) // block_size + 2 blocks. Fixed shapes, on device: no host wait."""
    B, T = pos.shape
    nb = (T - 1) // block_size + 2  # blocks a row's T increasing positions can touch
    blk = torch.div(pos, block_size, rounding_mode="floor")
    local = blk - blk[:, -1:] + (nb - 1)  # the last column is real, in the row's last block
    pad = F.pad(pos[:, :-1] >= pos[:, 1:], (0, 1), value=False) | (local < 0)
    ids = (local + torch.arange(B, device=pos.device)[:, None] * nb).masked_fill(pad, B * nb)
    return RoutingBlocks(ids.reshape(-1), B * nb + 1)


def admit(choice: torch.Tensor, blocks: RoutingBlocks, capacity: int) -> torch.Tensor:
    """`choice` [N, E] with the experts its block does not admit at -inf: a block's score
    per expert is the maximum of its tokens' scores, and the `capacity` best are admitted
    (a tie at the boundary, which the published topk breaks arbitrarily, keeps both).
    Six kernels whatever the blocks."""
    table = choice.new_full((blocks.count, choice.shape[1]), float("-inf"))
    table.scatter_reduce_(0, blocks.ids[:, None].expand_as(choice), choice, "amax")
    shut = table < table.topk(capacity, -1).values[:, -1:]
    return choice.masked_fill(shut.index_select(0, blocks.ids), float("-inf"))


def route(scores_logits: torch.Tensor, spec: MoESpec, bias, scaled: bool = True,
          blocks: Optional[RoutingBlocks] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(experts [N, k], weights [N, k]) of router logits [N, E] (in the router's dtype), the
    weights times `spec.scaling` unless not `scaled` (the grouped mixture applies it in its
    matmul, one kernel fewer). `blocks`: each token's routing block, which a block-routed
    spec needs (routing_blocks)."""
    scores = torch.softmax(scores_logits, -1) if spec.score == "softmax" else torch.sigmoid(scores_logits)
    choice = scores if bias is None else scores + bias.to(scores.dtype)
    if spec.bias_in_weights:
        scores = choice
    if spec.block_routed:  # LLaDA2.2: the block's admitted experts, whatever n_group says
        if blocks is None:
            raise ValueError("block routing (expert_capacity) needs each token's routing block: pass "
                             "blocks=routing_blocks(positions, block_size)")
        choice = admit(choice, blocks, spec.expert_capacity)
    elif spec.topk_group < spec.n_group:  # keep the topk_group groups whose best two choices score highest
        N, E = choice.shape
        by_group = choice.view(N, spec.n_group, E // spec.n_group)
        groups = by_group.topk(2, -1).values.sum(-1)
        # dropped: the groups scoring below the topk_group-th best, the published topk's
        # others (a tie at the boundary, which that topk breaks arbitrarily, keeps both):
        # one kernel fewer than a mask scattered from the topk's indices
        least = groups.topk(spec.topk_group, -1).values[:, -1:]
        choice = by_group.masked_fill((groups < least)[..., None], float("-inf")).view(N, E)
    experts = choice.topk(spec.top_k, -1).indices
    weights = scores.gather(1, experts)
    if spec.renormalize and spec.top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return experts, weights if spec.scaling == 1.0 or not scaled else weights * spec.scaling  # x * 1.0 is x: no kernel


def groupable(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether F.grouped_mm takes these operands: float32/bfloat16/float16 (not float64,
    whose model runs the reference loop), some experts, rows whose bytes are multiples of 16."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or w13.dtype != x.dtype or not len(w13):
        return False
    return all(n * x.element_size() % 16 == 0 for n in (w13.shape[-1], w2.shape[-1]))


@torch.library.custom_op("blockray::grouped_mm", mutates_args=())
def grouped_mm_any(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """F.grouped_mm as one opaque op, for the dtypes besides bfloat16 that eager runs (CPU
    float32) but torch's meta kernel refuses: dynamo and fake tensors trace it by shape."""
    return F.grouped_mm(a, b, offs=offs)


@grouped_mm_any.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[-1])


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """F.grouped_mm, through grouped_mm_any for a dtype torch's meta kernel refuses."""
    return F.grouped_mm(a, b, offs=offs) if a.dtype == torch.bfloat16 else grouped_mm_any(a, b, offs)


def experts_forward(x: torch.Tensor, router: torch.Tensor, bias, w13: torch.Tensor, w2: torch.Tensor,
                    spec: MoESpec, owned: Optional[range] = None, ids: Optional[torch.Tensor] = None,
                    into: Optional[torch.Tensor] = None, blocks: Optional[RoutingBlocks] = None) -> torch.Tensor:
    """The routed experts' mixture for x [..., d] with the experts stacked (Layer.fuse_):
    `w13` [E, 2f, d] (gate, then up), `w2` [E, d, f]. Every token is routed at once, the
    (token, expert) pairs sorted by expert, each expert's offset found on device
    (searchsorted), two grouped GEMMs, the outputs put back in (token, choice) order and
    mixed by one batched matmul that also applies the routed scaling: the same kernels
    whatever the routing, no host wait (no data-dependent size), and no atomic adds (a
    token's k outputs sum in one dot product, in a fixed order). `owned` (expert parallel,
    engine.models.sharding): `w13`/`w2` hold only these experts; the other pairs sort last,
    past every group, and count zero: the rank's partial mixture. `ids`: arange(E) made
    once (Layer.fuse_); `into`: a tensor shaped like x (the shared expert's output) the
    mixture is added to in place, instead of to zeros and then added. `blocks`: the
    tokens' routing blocks under block routing (route)."""
    shape, flat = x.shape, x.reshape(-1, x.shape[-1])
    grouped = groupable(x, w13, w2)
    rd = compute_dtype(x.dtype)
    chosen, weights = route(F.linear(flat.to(rd), router.to(rd)), spec, bias, scaled=not grouped,
                            blocks=blocks)
    (N, k), n = chosen.shape, w13.shape[0]
    e = chosen.reshape(-1)
    if owned is not None:  # another rank's experts as one key past the owned ones
        e = e - owned.start
        e = e.masked_fill((e < 0) | (e >= n), n)
    out = torch.zeros_like(flat) if into is None else into.view(flat.shape)
    if not grouped:
        return _experts_loop(flat, e, weights, w13, w2, out).view(shape)
    e, order = e.sort(stable=True)
    ids = torch.arange(n, device=e.device) if ids is None else ids
    offs = torch.searchsorted(e, ids, right=True, out_int32=True)  # each group's end
    g, u = _grouped_mm(flat[order // k], w13.transpose(-2, -1), offs).chunk(2, -1)
    y = _grouped_mm(F.silu(g) * u, w2.transpose(-2, -1), offs)
    if owned is not None:  # rows past the last group are not written by grouped_mm
        y = y.masked_fill(e[:, None] == n, 0)
    y = torch.empty_like(y).index_copy_(0, order, y)  # row t * k + j: token t's j-th choice
    out.view(N, 1, -1).baddbmm_(weights.to(x.dtype).view(N, 1, k), y.view(N, k, -1), alpha=spec.scaling)
    return out.view(shape)


def _experts_loop(flat: torch.Tensor, e: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The reference mixture (float64, or operands grouped_mm refuses) added to `out`: one
    matmul per expert over its tokens, with host syncs; pairs keyed past the last expert
    are skipped."""
    k, n = weights.shape[1], w13.shape[0]
    order = e.argsort(stable=True)
    counts = torch.bincount(e, minlength=n + 1).tolist()[:n]
    tokens = order // k
    xs, outs, o = flat[tokens], [], 0
    for j, c in enumerate(counts):  # one matmul per expert that has tokens
        if c:
            g, u = F.linear(xs[o:o + c], w13[j]).chunk(2, -1)
            outs.append(F.linear(F.silu(g) * u, w2[j]))
            o += c
    if not outs:
        return out
    y = torch.cat(outs) * weights.reshape(-1)[order[:o], None].to(flat.dtype)
    return out.index_add_(0, tokens[:o], y)
