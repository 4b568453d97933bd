"""The numerics every layer shares: RMSNorm and rotate-half RoPE in float32 (float64 for a
float64 model), as the published models compute them, in few kernels: RMSNorm is
aten's fused op (one kernel on CUDA; its decomposition, the same arithmetic, on a CPU),
RoPE is prepared once per forward (`Rope`) and costs 4 kernels per layer for q and k
together."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms, RoPE and routing run in float32, or float64 when the model itself is float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """weight * (x in the compute dtype, normalised, back in x's dtype), as published: one
    kernel in the compute dtype (float32, float64), four in bfloat16 (the cast in and out,
    and the weight applied after the rounding, as the published models do)."""
    cd = compute_dtype(x.dtype)
    if x.dtype == cd and (weight is None or weight.dtype == cd):
        return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)[0]
    out = torch.ops.aten._fused_rms_norm(x.to(cd), [x.shape[-1]], None, eps)[0].to(x.dtype)
    return out if weight is None else weight * out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope(pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype, yarn: Optional[Any] = None):
    """cos/sin of shape [B, 1, T, D] for rotate-half RoPE at integer positions `pos` [B, T];
    with `yarn` (engine.models.rope_scaling.Yarn) its inverse frequencies and attention factor."""
    cd = compute_dtype(dtype)
    if yarn is None:
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=cd) / head_dim))
    else:
        inv = yarn.inv_freq(head_dim, theta, cd, pos.device)
    ang = pos.to(cd)[..., None] * inv
    ang = torch.cat([ang, ang], dim=-1)[:, None]
    cos, sin = ang.cos(), ang.sin()
    if yarn is not None and yarn.attention_factor != 1.0:
        cos, sin = cos * yarn.attention_factor, sin * yarn.attention_factor
    return cos.to(dtype), sin.to(dtype)


@dataclass
class Rope:
    """RoPE at a forward's positions, prepared once for every layer, for heads laid out
    [B, T, heads, D]: x * cos, then swap(x) * sin added to the rotary dims in place, where
    `swap` exchanges the two halves of the rotary dims (a roll) and `sin`'s first half is
    negated (so swap(x) * sin is rotate_half(x) * sin, bit for bit). Past the rotary dims
    cos is 1, so a partial rotary passes those dims unchanged (LLaDA-MoE, LLaDA2) in the
    same 4 kernels as a full one (a cat of the rotated and passed dims would be a fifth)."""

    cos: torch.Tensor  # [B, T, 1, D]
    sin: torch.Tensor  # [B, T, 1, R]
    rotary: int  # R: the rotary dims, the first of each head's D
    q_scale: Optional[torch.Tensor] = None  # [B, T, 1, 1]: the rotated queries' scale by position (Llama-4's)

    @classmethod
    def at(cls, pos: torch.Tensor, rotary_dim: int, head_dim: int, theta: float, dtype: torch.dtype,
           yarn: Optional[Any] = None) -> "Rope":
        cos, sin = rope(pos, rotary_dim, theta, dtype, yarn)  # [B, 1, T, R]
        cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)
        h = rotary_dim // 2
        sin = torch.cat([-sin[..., :h], sin[..., h:]], -1)
        if rotary_dim < head_dim:
            cos = F.pad(cos, (0, head_dim - rotary_dim), value=1.0)
        return cls(cos, sin, rotary_dim)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        R = self.rotary
        out = x * self.cos
        out.narrow(-1, 0, R).add_(x.narrow(-1, 0, R).roll(R // 2, -1) * self.sin)
        return out
