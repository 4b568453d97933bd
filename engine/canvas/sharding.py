"""Tensor parallelism for DiffusionGemma (transformers' DiffusionGemmaForBlockDiffusion,
served by engine.canvas): its text layers sharded in place, the way engine.models.sharding
shards blockray's own transformer and as its family declares (Family.sharding, by
transformers' module names): in every encoder and decoder attention q/k/v column-parallel
by head (K/V heads replicated when fewer than N: its full-attention layers have one),
o row-parallel; in every dense MLP (and the self-conditioning MLP) gate/up column, down
row; the routed experts expert-parallel (rank r keeps experts [rE/N, (r+1)E/N) of the
stacked gate_up / down tensors and runs the tokens routed to them). Each row-parallel
output and the experts' partial mixture are all-reduced (engine.parallel). The
embedding, the LM head, norms, routers and the vision tower (never run: text only) are
replicated, so the logits are the whole vocabulary's on every rank without a gather.

What is not done: the checkpoint is read whole by transformers' from_pretrained and then
cut (engine.loader's masked-diffusion models read only their shard's byte ranges), and
the experts run transformers' eager path (its grouped kernels do not skip another rank's
experts)."""
from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from ..models.families import Shard
from ..models.sharding import RowParallelLinear, head_ranges

ATTENTION = ("DiffusionGemmaEncoderTextAttention", "DiffusionGemmaDecoderTextAttention")
MLPS = ("DiffusionGemmaText4MLP", "DiffusionGemmaSelfConditioning")
EXPERTS = "DiffusionGemmaTextExperts"


def _rows(linear: nn.Linear, ranges) -> None:
    """Keep the output rows `ranges` of `linear` (and of its bias)."""
    idx = torch.cat([torch.arange(a, b) for a, b in ranges])
    linear.weight = nn.Parameter(linear.weight.detach()[idx].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[idx].clone(), requires_grad=False)
    linear.out_features = len(idx)


def _row_parallel(linear: nn.Linear, cols, tp: Any) -> RowParallelLinear:
    """`linear` keeping input columns [cols), its output all-reduced, its bias added after."""
    a, b = cols
    out = RowParallelLinear(b - a, linear.out_features, linear.bias is not None, tp).to(linear.weight.dtype)
    out.weight = nn.Parameter(linear.weight.detach()[:, a:b].clone().to(linear.weight.device), requires_grad=False)
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    return out


def _split(n: int, rank: int, size: int, what: str):
    if n % size:
        from ..models.sharding import ShardingRefused

        raise ShardingRefused(f"tensor_parallel_size={size}: {what} {n} does not divide into {size} ranks")
    return rank * n // size, (rank + 1) * n // size


def shard_diffusion_gemma(model: nn.Module, family: Any, tp: Any) -> nn.Module:
    """Cut `model` (loaded whole) down to rank tp.rank's shard, in place (see the module
    docstring); `family`: DiffusionGemma's Family, whose `sharding` names the modules."""
    kind = family.sharding
    r, N = tp.rank, tp.size
    for name, m in list(model.named_modules()):
        cls = type(m).__name__
        if cls in ATTENTION:
            hd = m.head_dim
            H, Hkv = m.q_proj.out_features // hd, m.k_proj.out_features // hd
            heads, kv = head_ranges(H, Hkv, r, N)
            assert kind["q_proj"] == Shard.COLUMN and kind["k_proj"] == kind["v_proj"] == Shard.KV
            _rows(m.q_proj, [(heads[0] * hd, heads[1] * hd)])
            for proj in (m.k_proj, m.v_proj):
                if proj is not None:  # full-attention layers use k as v (no v_proj)
                    _rows(proj, [(kv[0] * hd, kv[1] * hd)])
            assert kind["o_proj"] == Shard.ROW
            m.o_proj = _row_parallel(m.o_proj, (heads[0] * hd, heads[1] * hd), tp)
            m.num_key_value_groups = (heads[1] - heads[0]) // (kv[1] - kv[0])
        elif cls in MLPS:
            f = m.gate_proj.out_features
            cols = _split(f, r, N, f"{name}'s intermediate size")
            _rows(m.gate_proj, [cols])
            _rows(m.up_proj, [cols])
            m.down_proj = _row_parallel(m.down_proj, cols, tp)
        elif cls == EXPERTS:
            assert kind["experts"] == Shard.EXPERT
            E = m.num_experts
            lo, hi = r * E // N, (r + 1) * E // N
            m.gate_up_proj = nn.Parameter(m.gate_up_proj.detach()[lo:hi].clone(), requires_grad=False)
            m.down_proj = nn.Parameter(m.down_proj.detach()[lo:hi].clone(), requires_grad=False)
            m.num_experts = hi - lo
            m.forward = types.MethodType(_experts_forward(type(m).forward, lo, hi, tp), m)
    model.tp = tp
    return model


def _experts_forward(forward, lo: int, hi: int, tp: Any):
    """The experts' forward over this rank's experts only: another rank's expert index
    becomes the one transformers' loop skips (num_experts), and the partial mixtures are
    summed across ranks."""

    def run(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        local = top_k_index - lo
        local = local.masked_fill((top_k_index < lo) | (top_k_index >= hi), hi - lo)
        return tp.all_reduce(forward(self, hidden_states, local, top_k_weights))

    return run


__all__ = ["shard_diffusion_gemma"]
