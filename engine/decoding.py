"""Decoding policies, vectorised over the batch: which masked positions of each row's
current block get a token this denoising step. Each row carries its own policy and
parameters, so one forward serves requests with different settings."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

FIXED, THRESHOLD, FACTOR = 0, 1, 2
POLICY_IDS = {"fixed": FIXED, "threshold": THRESHOLD, "factor": FACTOR}


@dataclass
class RowParams:
    """Per-row decoding parameters as [B] tensors (built once per batch layout)."""

    policy: torch.Tensor
    threshold: torch.Tensor
    factor: torch.Tensor
    temperature: torch.Tensor
    seeds: List[Optional[int]]  # Gumbel seed per row, None when temperature == 0

    @classmethod
    def build(cls, params: Sequence, seeds: Sequence[Optional[int]], device) -> "RowParams":
        f64 = dict(dtype=torch.float64, device=device)
        return cls(policy=torch.tensor([POLICY_IDS[p.policy] for p in params], device=device),
                   threshold=torch.tensor([float(p.threshold) for p in params], **f64),
                   factor=torch.tensor([float(p.factor) for p in params], **f64),
                   temperature=torch.tensor([float(p.temperature) for p in params], **f64),
                   seeds=list(seeds))


def fixed_schedule(step: torch.Tensor, block_length: int, steps: int) -> torch.Tensor:
    """LLaDA's schedule: L tokens over S steps as evenly as possible, earliest steps take
    the remainder. `step` [B] is each row's step index inside its block."""
    base, rem = divmod(block_length, steps)
    return base + (step < rem).long()


def _ranks(conf: torch.Tensor) -> torch.Tensor:
    """Rank of each position by descending confidence (0 = most confident); stable, so
    ties break by position the same way in any batch."""
    order = conf.argsort(dim=1, descending=True, stable=True)
    ar = torch.arange(conf.shape[1], device=conf.device).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, ar)


def propose(logits: torch.Tensor, rp: RowParams, noise_keys: Optional[Sequence[Optional[int]]],
            need: torch.Tensor):
    """Candidate tokens x0 [B, L] and their float64 softmax confidence [B, L] (0 where
    `need` is False: only masked positions are ever selected, and the float64 softmax
    over the vocabulary is the biggest host cost of a step). Rows at temperature > 0
    take x0 from Gumbel-perturbed logits in float64 (as LLaDA's reference does), seeded
    per row (`noise_keys`, None when no row samples) so a request's tokens do not depend
    on its batch."""
    x0 = logits.argmax(-1)  # float -> float64 is exact, so this is the float64 argmax
    for i, key in enumerate(noise_keys or ()):
        if key is None:
            continue
        lg = logits[i].to(torch.float64)
        g = torch.Generator(device=lg.device).manual_seed(key)
        noise = torch.rand(lg.shape, generator=g, dtype=torch.float64, device=lg.device)
        x0[i] = (lg - rp.temperature[i] * torch.log(-torch.log(noise))).argmax(-1)
    idx = need.nonzero(as_tuple=True)
    conf = torch.zeros(x0.shape, dtype=torch.float64, device=x0.device)
    conf[idx] = torch.softmax(logits[idx].to(torch.float64), dim=-1).gather(-1, x0[idx][:, None]).squeeze(-1)
    return x0, conf


def select(conf: torch.Tensor, is_mask: torch.Tensor, step: torch.Tensor, rp: RowParams,
           block_length: int, steps: int) -> torch.Tensor:
    """Boolean [B, L]: positions to unmask this step."""
    conf = torch.where(is_mask, conf, torch.full_like(conf, -1.0))
    rank = _ranks(conf)
    has_mask = is_mask.any(1, keepdim=True)
    # fixed: the k_s most confident masked positions
    by_fixed = rank < fixed_schedule(step, block_length, steps)[:, None]
    # threshold: every confident position, at least the most confident one
    by_threshold = (conf >= rp.threshold[:, None]) | (rank == 0)
    # factor (Fast-dLLM): the n-th most confident is taken while c_(n) >= 1 - f/(n+1)
    sorted_conf = conf.sort(dim=1, descending=True).values
    n = torch.arange(1, conf.shape[1] + 1, device=conf.device, dtype=torch.float64)
    need = 1.0 - rp.factor[:, None] / (n + 1.0)
    need[:, 0] = -2.0
    n_take = (sorted_conf >= need).long().cumprod(dim=1).sum(dim=1)
    by_factor = rank < n_take[:, None]
    pol = rp.policy[:, None]
    sel = torch.where(pol == FIXED, by_fixed, torch.where(pol == THRESHOLD, by_threshold, by_factor))
    last = (step >= steps - 1)[:, None]
    return (sel | last) & is_mask & has_mask
