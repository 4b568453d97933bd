"""RoPE scalings beyond the default rotation, as transformers computes them, declared as
data (torch-free) on ModelConfig and computed here when a forward needs them:

- YaRN (transformers' `_compute_yarn_parameters`): the inverse frequencies blended between
  interpolated (divided by `factor`) and extrapolated ones by a linear ramp over the
  dimensions between the correction range of `beta_fast` / `beta_slow` rotations, and cos /
  sin multiplied by the attention factor (given, else mscale's ratio, else 0.1 ln(factor) + 1).
- Llama-4's query scaling by position (Ministral3's `get_llama_4_attn_scale`): the rotated
  queries times 1 + beta ln(1 + floor(pos / original_max_position_embeddings)), which is 1
  below that length.

Nemotron-Labs-Diffusion (Ministral3's layer) uses both."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple


@dataclass(frozen=True)
class Yarn:
    """YaRN's parameters, resolved as transformers resolves them (`attention_factor` final)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    def correction_range(self, dim: int, theta: float) -> Tuple[float, float]:
        """The dimension range (low, high) the ramp runs over (transformers' find_correction_range)."""
        def at(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(theta))
        low, high = at(self.beta_fast), at(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def inv_freq(self, dim: int, theta: float, dtype: Any, device: Any):
        """The blended inverse frequencies [dim / 2] in `dtype` (float32 as transformers, float64
        for a float64 model)."""
        import torch

        pos_freqs = theta ** (torch.arange(0, dim, 2, device=device, dtype=dtype) / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)
        low, high = self.correction_range(dim, theta)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = ((torch.arange(dim // 2, device=device, dtype=dtype) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # the extrapolation's share
        return interpolation * (1 - keep) + extrapolation * keep


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_from(params: Any, max_position_embeddings: Optional[int]) -> Yarn:
    """Yarn from a config.json `rope_parameters` of rope_type "yarn", resolved as transformers
    5's _compute_yarn_parameters resolves it (factor from the context ratio when None; the
    attention factor given, else mscale / mscale_all_dim's ratio when both are set, else
    from the factor alone; beta_fast / beta_slow 32 / 1 when unset or 0)."""
    orig = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / orig
    factor = float(factor)
    attn = params.get("attention_factor")
    if attn is None:
        ms, ms_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = yarn_mscale(factor, ms) / yarn_mscale(factor, ms_all) if ms and ms_all else yarn_mscale(factor)
    return Yarn(factor=factor, original_max_position_embeddings=orig, beta_fast=float(params.get("beta_fast") or 32),
                beta_slow=float(params.get("beta_slow") or 1), attention_factor=float(attn),
                truncate=bool(params.get("truncate", True)))


def llama4_q_scale(pos: Any, beta: float, original_max: int, dtype: Any):
    """[B, T, 1, 1] query scale at positions `pos` [B, T] (Ministral3's get_llama_4_attn_scale,
    in the compute dtype, then `dtype` as its caller casts it)."""
    import torch

    from .ops import compute_dtype

    cd = compute_dtype(dtype)
    scale = 1 + beta * torch.log(1 + torch.floor(pos.to(cd) / original_max))
    return scale.to(dtype)[..., None, None]
