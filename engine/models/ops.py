"""The numerics every layer shares: RMSNorm and rotate-half RoPE in float32 (float64 for a
float64 model), as the published models compute them."""
from __future__ import annotations

import torch
from torch import nn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms, RoPE and routing run in float32, or float64 when the model itself is float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(compute_dtype(x.dtype))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope(pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin of shape [B, 1, T, D] for rotate-half RoPE at integer positions `pos` [B, T]."""
    cd = compute_dtype(dtype)
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=cd) / head_dim))
    ang = pos.to(cd)[..., None] * inv
    ang = torch.cat([ang, ang], dim=-1)[:, None]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] dims of each head of `t` [B, H, T, D]; the rest pass
    (partial rotary: LLaDA-MoE, LLaDA2)."""
    r = cos.shape[-1]
    if r == t.shape[-1]:
        return t * cos + rotate_half(t) * sin
    a = t[..., :r]
    return torch.cat([a * cos + rotate_half(a) * sin, t[..., r:]], -1)
