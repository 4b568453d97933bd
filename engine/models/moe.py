"""Mixture-of-experts blocks (LLaDA-MoE): the attention of transformer.Layer with QK
RMSNorm and partial RoPE, and an MLP of routed experts (plus an optional shared expert)
or a dense MLP where the config says so. Routing is vectorised over tokens in float32
(float64 for a float64 model); experts run grouped: the (token, expert) pairs are sorted
by expert, each expert does one matmul over its tokens, and the weighted outputs are
scattered back with one index_add. No Python loop over tokens."""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .families.moe import MoESpec
from .transformer import Layer, RMSNorm, _compute_dtype, _rotate_half


class MLP(nn.Module):
    """SwiGLU without biases: one expert, the shared expert, or a dense layer's MLP."""

    def __init__(self, d: int, f: int):
        super().__init__()
        self.gate = nn.Linear(d, f, bias=False)
        self.up = nn.Linear(d, f, bias=False)
        self.down = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


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


def experts_forward(x: torch.Tensor, router: torch.Tensor, bias, experts: nn.ModuleList, spec: MoESpec):
    """The routed experts' mixture for x [..., d]: route every token at once, sort the
    (token, expert) pairs by expert, one matmul per expert over its tokens, one index_add."""
    shape, flat = x.shape, x.reshape(-1, x.shape[-1])
    rd = _compute_dtype(x.dtype)
    chosen, weights = route(F.linear(flat.to(rd), router.to(rd)), spec, bias)
    k = chosen.shape[1]
    order = chosen.reshape(-1).argsort(stable=True)
    tokens = order // k
    counts = torch.bincount(chosen.reshape(-1), minlength=spec.num_experts).tolist()
    xs, outs, o = flat[tokens], [], 0
    for e, n in enumerate(counts):  # one matmul per expert that has tokens
        if n:
            outs.append(experts[e](xs[o:o + n]))
            o += n
    y = torch.cat(outs) * weights.reshape(-1)[order, None].to(x.dtype)
    return torch.zeros_like(flat).index_add_(0, tokens, y).view(shape)


class MoELayer(Layer):
    """transformer.Layer with QK norm, partial RoPE and an expert (or dense) MLP."""

    def __init__(self, cfg: ModelConfig, index: int):
        nn.Module.__init__(self)
        d, kv, hd = cfg.hidden_size, cfg.n_kv_heads * cfg.head_dim, cfg.head_dim
        self.cfg = cfg
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv, bias=False)
        self.v = nn.Linear(d, kv, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(hd, cfg.rms_norm_eps), RMSNorm(hd, cfg.rms_norm_eps)
        self.mlp_norm = RMSNorm(d, cfg.rms_norm_eps)
        spec = cfg.moe
        if spec is not None and spec.dense_layers[index]:
            self.dense = MLP(d, spec.dense_size)
        elif spec is not None:
            self.router = nn.Linear(d, spec.num_experts, bias=False)
            self.expert_bias = nn.Parameter(torch.zeros(spec.num_experts)) if spec.expert_bias else None
            self.experts = nn.ModuleList(MLP(d, spec.expert_size) for _ in range(spec.num_experts))
            if spec.shared_size:
                self.shared = MLP(d, spec.shared_size)

    def qkv(self, x, cos, sin):
        D, r = self.cfg.head_dim, cos.shape[-1]
        q, k, v = self.heads(x)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        def rot(t):  # RoPE on the first r dims of each head, the rest passes
            a = t[..., :r]
            return torch.cat([a * cos + _rotate_half(a) * sin, t[..., r:]], -1) if r < D else a * cos + _rotate_half(a) * sin
        return rot(q), rot(k), v

    def heads(self, x):
        """q [B, T, H, D], k and v [B, T, H_kv, D] (engine.models.llada2: one fused projection)."""
        B, T, _ = x.shape
        H, Hkv, D = self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim
        return self.q(x).view(B, T, H, D), self.k(x).view(B, T, Hkv, D), self.v(x).view(B, T, Hkv, D)

    def ffn(self, x):
        if hasattr(self, "dense"):
            return self.dense(x)
        out = experts_forward(x, self.router.weight, self.expert_bias, self.experts, self.cfg.moe)
        return out + self.shared(x) if hasattr(self, "shared") else out
